"""Expert adapters: LoRA for every expert of a mixture-of-experts backbone, in PEFT's adapter layout.

An expert adapter is a PEFT LoRA directory that `read_adapter` (and any safetensors reader) reads as usual:

- `adapter_config.json`: PEFT's LoRA fields; `target_modules` names the attention projections (if any) and
  `gate_up_proj`, `down_proj`; plus `"lorafaas_experts": {"version": 1, "num_experts": E}`, which marks it.
- `adapter_model.safetensors`: attention pairs as usual, and for each MoE layer, expert e and projection
  `base_model.model.<experts path>.<e>.<projection>.lora_A.weight`  [r, in_features]
  `base_model.model.<experts path>.<e>.<projection>.lora_B.weight`  [out_features, r]
  where the projections are the backbone's fused expert parameters taken one expert at a time (transformers 5
  Mixtral/Qwen-MoE): `gate_up_proj` maps hidden -> 2 x intermediate (gate rows, then up rows), `down_proj` maps
  intermediate -> hidden. Expert e adds `B_e(A_e(x)) * scaling` to its projection of the rows routed to it, exactly
  what a PEFT `Linear` per expert computes.

Per-expert 2-D factors (rather than PEFT's fused `target_parameters` layout, whose tensor names depend on the order
the parameters were listed in) keep every tensor self-describing and let the LoRA server load one layer at a time.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lorafaas.errors import AdapterIncompatible, AdapterInvalid
from lorafaas.formats.adapter_files import CONFIG_FILE, PEFT_PREFIX, WEIGHTS_FILE, read_adapter
from lorafaas.formats.weights import read_safetensors_header

if TYPE_CHECKING:  # torch is imported where the factors are loaded, not by the format checks
    import torch

EXPERTS_KEY = "lorafaas_experts"
FORMAT_VERSION = 1
PROJECTIONS = ("gate_up_proj", "down_proj")
_EXPERT_MODULE = re.compile(r"^(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<projection>gate_up_proj|down_proj)$")
_LAYER_NUMBER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_number(experts_path: str) -> int:
    """The layer an experts module belongs to: the first number in its path ("model.layers.12.mlp.experts" -> 12)."""
    match = _LAYER_NUMBER.search(experts_path)
    if match is None:
        raise AdapterInvalid(f"cannot tell which layer {experts_path!r} belongs to (no layer number in the path)")
    return int(match.group(1))


def parse_expert_module(module_path: str) -> tuple[str, int, str] | None:
    """(experts path, expert, projection) if `module_path` is one expert's projection, else None."""
    match = _EXPERT_MODULE.match(module_path)
    if match is None:
        return None
    return match["experts"], int(match["expert"]), match["projection"]


@dataclass(frozen=True)
class ExpertLayout:
    """A backbone's MoE layers: where its fused experts are and their sizes."""

    experts_paths: dict[int, str]  # layer number -> experts module path, e.g. 0 -> "model.layers.0.mlp.experts"
    num_experts: int
    hidden_size: int
    intermediate_size: int

    def features(self, projection: str) -> tuple[int, int]:
        """(in_features, out_features) of one expert's projection."""
        if projection == "gate_up_proj":
            return self.hidden_size, 2 * self.intermediate_size
        return self.intermediate_size, self.hidden_size


def read_expert_layout(model_dir: Path) -> ExpertLayout:
    """The MoE layout of a backbone directory, from its model built on the meta device (no weights read).

    The module tree, not the checkpoint, is what adapters attach to: transformers 5 saves Mixtral in the legacy
    per-expert layout (`block_sparse_moe.experts.<e>.w1`) and fuses it into `mlp.experts.gate_up_proj` on load.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(Path(model_dir))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError) as exc:
        raise AdapterIncompatible(f"cannot read the model config of backbone {model_dir}: {exc}") from exc
    found = {}
    for name, module in model.named_modules():
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3:
            found[name] = (tuple(gate_up.shape), tuple(down.shape))
    if not found:
        raise AdapterIncompatible(f"backbone {model_dir} has no fused MoE experts (gate_up_proj/down_proj)")
    if len(set(found.values())) != 1:
        raise AdapterIncompatible(f"backbone {model_dir}: MoE layers differ in shape; only uniform layers are served")
    ((gate_up, down),) = set(found.values())
    num_experts, two_intermediate, hidden = gate_up
    if down != (num_experts, hidden, two_intermediate // 2):
        raise AdapterIncompatible(f"backbone {model_dir}: gate_up_proj {gate_up} and down_proj {down} do not fit")
    return ExpertLayout(
        experts_paths={layer_number(path): path for path in found},
        num_experts=num_experts,
        hidden_size=hidden,
        intermediate_size=two_intermediate // 2,
    )


def expert_layer_shapes(layout: ExpertLayout) -> dict[str, tuple[int, int]]:
    """Module path -> (out_features, in_features) of every expert's projection, as adapter validation sees layers."""
    shapes = {}
    for experts_path in layout.experts_paths.values():
        for projection in PROJECTIONS:
            in_features, out_features = layout.features(projection)
            for expert in range(layout.num_experts):
                shapes[f"{experts_path}.{expert}.{projection}"] = (out_features, in_features)
    return shapes


@dataclass(frozen=True)
class ExpertAdapterInfo:
    path: Path
    rank: int
    scaling: float
    num_experts: int
    projections: dict[int, tuple[str, ...]]  # layer number -> projections it adapts
    experts_paths: dict[int, str]
    attention_modules: tuple[str, ...]  # every non-expert module path
    expert_bytes: int
    attention_bytes: int

    def summary(self) -> dict:
        return {
            "path": str(self.path),
            "rank": self.rank,
            "scaling": self.scaling,
            "num_experts": self.num_experts,
            "num_moe_layers": len(self.projections),
            "attention_modules": len(self.attention_modules),
            "expert_bytes": self.expert_bytes,
            "attention_bytes": self.attention_bytes,
        }


def is_expert_adapter(path: Path) -> bool:
    """Whether the adapter's config marks it as an expert adapter (reads only adapter_config.json)."""
    try:
        config = json.loads((Path(path) / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and EXPERTS_KEY in config


def read_expert_adapter_info(path: Path) -> ExpertAdapterInfo:
    """Check an expert adapter's own files (headers only): marker, complete expert sets, one rank."""
    info = read_adapter(path)
    marker = info.config.get(EXPERTS_KEY)
    if not isinstance(marker, dict) or marker.get("version") != FORMAT_VERSION:
        raise AdapterInvalid(
            f"{info.path}: {CONFIG_FILE} has no {EXPERTS_KEY!r} of version {FORMAT_VERSION}; "
            "not an expert adapter (create one with `lorafaas moe create-adapter`)"
        )
    num_experts = marker.get("num_experts")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise AdapterInvalid(f"{info.path}: {EXPERTS_KEY}.num_experts must be a positive integer, got {num_experts!r}")
    if info.config.get("rank_pattern") or info.config.get("alpha_pattern"):
        raise AdapterInvalid(f"{info.path}: rank_pattern/alpha_pattern are not supported for expert adapters")
    experts: dict[tuple[str, str], set[int]] = {}
    attention, expert_bytes, attention_bytes = [], 0, 0
    for module in info.modules:
        nbytes = sum(info.header.tensors[f"{PEFT_PREFIX}{module.path}.lora_{s}.weight"].num_bytes for s in "AB")
        parsed = parse_expert_module(module.path)
        if parsed is None:
            attention.append(module.path)
            attention_bytes += nbytes
            continue
        experts_path, expert, projection = parsed
        if module.rank != info.rank:
            raise AdapterInvalid(
                f"{info.path}: {module.path} has rank {module.rank}; expert factors must all have "
                f"the adapter's rank {info.rank}"
            )
        experts.setdefault((experts_path, projection), set()).add(expert)
        expert_bytes += nbytes
    if not experts:
        raise AdapterInvalid(f"{info.path}: no expert factors (<experts>.<e>.gate_up_proj/down_proj)")
    projections: dict[int, list[str]] = {}
    experts_paths: dict[int, str] = {}
    for (experts_path, projection), present in sorted(experts.items()):
        if present != set(range(num_experts)):
            missing = sorted(set(range(num_experts)) - present)[:5]
            extra = sorted(present - set(range(num_experts)))[:5]
            raise AdapterInvalid(
                f"{info.path}: {experts_path}.{projection} must have factors for experts "
                f"0..{num_experts - 1}; missing {missing}, unexpected {extra}"
            )
        layer = layer_number(experts_path)
        if experts_paths.setdefault(layer, experts_path) != experts_path:
            raise AdapterInvalid(f"{info.path}: layer {layer} has two experts modules ({experts_path})")
        projections.setdefault(layer, []).append(projection)
    use_rslora = bool(info.config.get("use_rslora"))
    return ExpertAdapterInfo(
        path=info.path,
        rank=info.rank,
        scaling=info.alpha / math.sqrt(info.rank) if use_rslora else info.alpha / info.rank,
        num_experts=num_experts,
        projections={k: tuple(v) for k, v in projections.items()},
        experts_paths=experts_paths,
        attention_modules=tuple(attention),
        expert_bytes=expert_bytes,
        attention_bytes=attention_bytes,
    )


def check_against_layout(info: ExpertAdapterInfo, layout: ExpertLayout, backbone: str) -> None:
    """Raise AdapterIncompatible unless the adapter's MoE layers and expert counts are the backbone's."""
    if info.num_experts != layout.num_experts:
        raise AdapterIncompatible(
            f"adapter {info.path} has {info.num_experts} experts per layer; backbone "
            f"{backbone!r} has {layout.num_experts}"
        )
    for layer, experts_path in info.experts_paths.items():
        if layout.experts_paths.get(layer) != experts_path:
            raise AdapterIncompatible(
                f"adapter {info.path} adapts {experts_path}, which backbone {backbone!r} does not have"
            )


def check_expert_adapter(path: Path, model_dir: Path, backbone: str) -> dict[str, tuple[int, int]]:
    """For `validate_adapter`: check the expert sets, return the per-expert layers its shape checks then cover."""
    info = read_expert_adapter_info(path)
    layout = read_expert_layout(model_dir)
    check_against_layout(info, layout, backbone)
    return expert_layer_shapes(layout)


@dataclass(frozen=True)
class ExpertFactors:
    """One projection of one MoE layer, every expert stacked: a [experts, r, in], b [experts, out, r]."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def num_bytes(self) -> int:
        return self.a.nbytes + self.b.nbytes


def load_expert_layer(
    info: ExpertAdapterInfo, layer: int, device: str = "cpu", weights: Path | None = None
) -> dict[str, ExpertFactors]:
    """Read one MoE layer's factors (only its tensors) from the adapter file (`weights`, if given, instead of the
    one in `info.path`: the LoRA server passes a file it opened itself); {} if the adapter skips the layer."""
    import torch
    from safetensors import safe_open

    projections = info.projections.get(layer, ())
    if not projections:
        return {}
    experts_path = info.experts_paths[layer]
    factors = {}
    with safe_open(str(weights or Path(info.path) / WEIGHTS_FILE), framework="pt") as f:
        for projection in projections:
            names = [f"{PEFT_PREFIX}{experts_path}.{e}.{projection}" for e in range(info.num_experts)]
            a = torch.stack([f.get_tensor(f"{n}.lora_A.weight") for n in names]).to(device)
            b = torch.stack([f.get_tensor(f"{n}.lora_B.weight") for n in names]).to(device)
            factors[projection] = ExpertFactors(a=a.contiguous(), b=b.contiguous(), scaling=info.scaling)
    return factors


def write_expert_adapter(
    out_dir: Path,
    model_dir: Path,
    *,
    rank: int = 4,
    alpha: int = 8,
    attention_modules: tuple[str, ...] = ("q_proj", "v_proj"),
    seed: int = 0,
    scale: float = 0.05,
    base_model_name: str | None = None,
) -> Path:
    """A random (non-zero) expert adapter for the backbone in `model_dir`: every expert of every MoE layer."""
    import torch
    from safetensors.torch import save_file

    if rank < 1:
        raise AdapterInvalid(f"rank must be >= 1, got {rank}")
    layout = read_expert_layout(model_dir)
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}

    def pair(module: str, in_features: int, out_features: int) -> None:
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * scale
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * scale

    for weight_file in sorted(Path(model_dir).glob("*.safetensors")):
        for name, info in sorted(read_safetensors_header(weight_file).tensors.items()):
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and len(info.shape) == 2 and module.rsplit(".", 1)[-1] in attention_modules:
                pair(module, info.shape[1], info.shape[0])
    for _layer, experts_path in sorted(layout.experts_paths.items()):
        for projection in PROJECTIONS:
            in_features, out_features = layout.features(projection)
            for expert in range(layout.num_experts):
                pair(f"{experts_path}.{expert}.{projection}", in_features, out_features)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / WEIGHTS_FILE)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": [*attention_modules, *PROJECTIONS],
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        EXPERTS_KEY: {"version": FORMAT_VERSION, "num_experts": layout.num_experts},
    }
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out_dir
