"""Reading a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) without torch.

`read_adapter` checks the adapter's own files and returns what `inspect` shows; validation against a backbone is in
`validate.py`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lorafaas.errors import AdapterInvalid, MalformedModel, PickledWeightsRefused
from lorafaas.weights import SafetensorsHeader, TensorInfo, pickled_files, read_safetensors_header

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT saves "base_model.model.<module path>.lora_A.weight"; the adapter name is stripped on save.
PEFT_PREFIX = "base_model.model."
LORA_SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B"}


@dataclass(frozen=True)
class LoraModule:
    path: str  # module path inside the base model, e.g. "model.layers.0.self_attn.q_proj"
    rank: int
    in_features: int
    out_features: int


@dataclass(frozen=True)
class AdapterInfo:
    path: Path
    base_model: str | None
    rank: int
    alpha: float
    target_modules: list[str] | str
    num_bytes: int
    num_parameters: int
    modules: list[LoraModule]
    config: dict
    header: SafetensorsHeader

    def summary(self) -> dict:
        return {
            "path": str(self.path),
            "base_model": self.base_model,
            "rank": self.rank,
            "alpha": self.alpha,
            "target_modules": self.target_modules,
            "num_modules": len(self.modules),
            "num_parameters": self.num_parameters,
            "bytes": self.num_bytes,
        }


def read_adapter(path: Path) -> AdapterInfo:
    path = Path(path).expanduser()
    if not path.is_dir():
        raise AdapterInvalid(f"{path} is not a directory; an adapter is a directory with {CONFIG_FILE} and "
                             f"{WEIGHTS_FILE}")
    pickled = pickled_files(path)
    if pickled:
        raise PickledWeightsRefused(
            f"{path} contains pickled weights ({', '.join(p.name for p in pickled)}); loading a pickle can run "
            f"arbitrary code, so lorafaas accepts {WEIGHTS_FILE} only. Re-save with "
            "`model.save_pretrained(dir, safe_serialization=True)`"
        )
    config = _read_config(path / CONFIG_FILE)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise AdapterInvalid(f"{path} has no {WEIGHTS_FILE}")
    try:
        header = read_safetensors_header(weights)
    except MalformedModel as exc:
        raise AdapterInvalid(exc.message) from exc
    modules = _lora_modules(path, header.tensors)
    ranks = {m.rank for m in modules}
    if config["r"] not in ranks and not config.get("rank_pattern"):
        raise AdapterInvalid(
            f"rank mismatch: {CONFIG_FILE} says r={config['r']} but the weights have rank "
            f"{', '.join(str(r) for r in sorted(ranks))} (e.g. {modules[0].path}.lora_A has rank {modules[0].rank})"
        )
    return AdapterInfo(
        path=path,
        base_model=config.get("base_model_name_or_path") or None,
        rank=int(config["r"]),
        alpha=float(config.get("lora_alpha", config["r"])),
        target_modules=config.get("target_modules") or [],
        num_bytes=weights.stat().st_size,
        num_parameters=header.num_parameters,
        modules=modules,
        config=config,
        header=header,
    )


def set_base_model(adapter_dir: Path, base_model: str) -> None:
    """Record which backbone an adapter is for (after PEFT saved it with a local path, which PEFT needs)."""
    config_path = Path(adapter_dir) / CONFIG_FILE
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = base_model
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _read_config(config_path: Path) -> dict:
    if not config_path.is_file():
        raise AdapterInvalid(f"{config_path.parent} has no {CONFIG_FILE}; expected a PEFT LoRA adapter directory")
    try:
        config = json.loads(config_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterInvalid(f"{config_path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterInvalid(f"{config_path} is not a JSON object")
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise AdapterInvalid(f"{config_path}: peft_type is {peft_type!r}; lorafaas serves LoRA adapters ('LORA')")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise AdapterInvalid(f"{config_path}: r must be a positive integer, got {rank!r}")
    targets = config.get("target_modules")
    if not (isinstance(targets, str) or (isinstance(targets, list) and all(isinstance(t, str) for t in targets))):
        raise AdapterInvalid(f"{config_path}: target_modules must be a list of names or a regex, got {targets!r}")
    return config


def _lora_modules(path: Path, tensors: dict[str, TensorInfo]) -> list[LoraModule]:
    pairs: dict[str, dict[str, TensorInfo]] = {}
    for name, info in tensors.items():
        for suffix, side in LORA_SUFFIXES.items():
            if name.endswith(suffix):
                module = name[: -len(suffix)].removeprefix(PEFT_PREFIX)
                pairs.setdefault(module, {})[side] = info
                break
    if not pairs:
        raise AdapterInvalid(f"{path / WEIGHTS_FILE} holds no LoRA weights (no '*.lora_A.weight' tensors)")
    modules = []
    for module, sides in sorted(pairs.items()):
        if set(sides) != {"A", "B"}:
            missing = "lora_B" if "A" in sides else "lora_A"
            raise AdapterInvalid(f"{path / WEIGHTS_FILE}: module {module} has no {missing} weight")
        a, b = sides["A"], sides["B"]
        if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != b.shape[1]:
            raise AdapterInvalid(
                f"{path / WEIGHTS_FILE}: module {module} has lora_A {a.shape} and lora_B {b.shape}; expected "
                "[r, in_features] and [out_features, r]"
            )
        modules.append(LoraModule(path=module, rank=a.shape[0], in_features=a.shape[1], out_features=b.shape[0]))
    return modules
