"""Reading a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) without torch.

`read_adapter` checks the adapter's own files and returns what `inspect` shows; validation against a backbone is in
`validate.py`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lorafaas.errors import AdapterInvalid, MalformedModel, PickledWeightsRefused
from lorafaas.formats.adapter_rules import (
    DEFAULT_LORA_ALPHA,
    AdapterLayout,
    check_config,
    plan_tensors,
)
from lorafaas.formats.adapter_rules import (
    PEFT_PREFIX as PEFT_PREFIX,  # PEFT saves "base_model.model.<module path>.lora_A.weight"
)
from lorafaas.formats.weights import SafetensorsHeader, pickled_files, read_safetensors_header

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


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
    layout: AdapterLayout

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
    patterns = check_config(config)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise AdapterInvalid(f"{path} has no {WEIGHTS_FILE}")
    try:
        header = read_safetensors_header(weights)
    except MalformedModel as exc:
        raise AdapterInvalid(exc.message) from exc
    layout = plan_tensors(config, header.tensors, patterns)
    modules = [LoraModule(path=p, rank=e.rank, in_features=e.shapes[0], out_features=e.shapes[1])
               for p, e in layout.loras.items()]
    return AdapterInfo(
        path=path,
        base_model=config.get("base_model_name_or_path") or None,
        rank=int(config["r"]),
        alpha=float(config.get("lora_alpha", DEFAULT_LORA_ALPHA)),
        target_modules=config.get("target_modules") or [],
        num_bytes=weights.stat().st_size,
        num_parameters=header.num_parameters,
        modules=modules,
        config=config,
        header=header,
        layout=layout,
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
