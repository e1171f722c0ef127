"""Unmerged LoRA beside a shared, read-only backbone.

The backbone's linear layers are wrapped, never modified: `LoraLinear` computes `base(x) + B(A(x)) * scaling` with the
same operations, in the same order, as PEFT's LoRA layer, so outputs equal PEFT's bit for bit. Loading is a
safetensors read (memory-mapped) plus a few dozen attribute assignments, far faster than `PeftModel.from_pretrained`.

An adapter moves through the tiers the scheduler reasons about: `HostAdapter` (read into host memory), placed on the
device (`attach_adapter`), offloaded back (`detach_adapter`, keeps the host copy), dropped (forget the HostAdapter).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lorafaas.errors import AdapterIncompatible
from lorafaas.platform.adapters.files import LORA_SUFFIXES, PEFT_PREFIX, WEIGHTS_FILE, read_adapter


@dataclass(frozen=True)
class LoraWeights:
    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]
    scaling: float


@dataclass(frozen=True)
class HostAdapter:
    """An adapter read into host memory: module path -> LoRA weights."""

    path: Path
    modules: dict[str, LoraWeights]

    @property
    def num_bytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.modules.values())


def read_host_adapter(path: Path) -> HostAdapter:
    """Read and check a PEFT LoRA adapter into host memory (no model needed)."""
    from safetensors.torch import load_file

    info = read_adapter(path)
    config = info.config
    if config.get("use_dora"):
        raise AdapterIncompatible(f"{path}: DoRA adapters are not supported; use plain LoRA")
    if config.get("fan_in_fan_out"):
        raise AdapterIncompatible(f"{path}: fan_in_fan_out (Conv1D) adapters are not supported")
    tensors = load_file(Path(path) / WEIGHTS_FILE)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        for suffix, side in LORA_SUFFIXES.items():
            if name.endswith(suffix):
                pairs.setdefault(name[: -len(suffix)].removeprefix(PEFT_PREFIX), {})[side] = tensor
    modules = {
        module: LoraWeights(a=sides["A"], b=sides["B"], scaling=_scaling(config, module, sides["A"].shape[0]))
        for module, sides in pairs.items()
    }
    return HostAdapter(path=Path(path), modules=modules)


def _scaling(config: dict, module: str, rank: int) -> float:
    alpha = config.get("lora_alpha", config["r"])
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if module == pattern or module.endswith("." + pattern):
            alpha = value
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


class LoraLinear(nn.Module):
    """A linear layer of the shared backbone with an optional private LoRA beside it."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.lora_a: torch.Tensor | None = None
        self.lora_b: torch.Tensor | None = None
        self.scaling = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base(x)
        if self.lora_a is None:
            return result
        # Same operations and order as peft.tuners.lora.Linear.forward (lora_B(lora_A(x)) * scaling).
        return result + F.linear(F.linear(x.to(self.lora_a.dtype), self.lora_a), self.lora_b) * self.scaling


def attach_adapter(model: nn.Module, adapter: HostAdapter, device: torch.device | str = "cpu") -> int:
    """Place the adapter's weights on `device` beside the model's layers; returns the bytes placed.

    Replaces any adapter attached before. Raises AdapterIncompatible if a module is missing or shapes disagree.
    """
    detach_adapter(model)
    placed = 0
    for path, weights in adapter.modules.items():
        layer = _lora_layer(model, path)
        base = layer.base
        if weights.a.shape[1] != base.in_features or weights.b.shape[0] != base.out_features:
            raise AdapterIncompatible(
                f"shape mismatch at {path}: the adapter maps {weights.a.shape[1]} -> {weights.b.shape[0]} features, "
                f"the backbone {base.in_features} -> {base.out_features}"
            )
        layer.lora_a = weights.a.to(device, non_blocking=True)
        layer.lora_b = weights.b.to(device, non_blocking=True)
        layer.scaling = weights.scaling
        placed += weights.a.nbytes + weights.b.nbytes
    return placed


def detach_adapter(model: nn.Module) -> None:
    """Remove the adapter from the device; the model computes the plain backbone again."""
    for module in model.modules():
        if isinstance(module, LoraLinear):
            module.lora_a = module.lora_b = None
            module.scaling = 0.0


def _lora_layer(model: nn.Module, path: str) -> LoraLinear:
    parent_path, _, child = path.rpartition(".")
    try:
        parent = model.get_submodule(parent_path) if parent_path else model
        module = getattr(parent, child)
    except AttributeError as exc:
        raise AdapterIncompatible(f"the adapter targets {path}, which the backbone does not have") from exc
    if isinstance(module, LoraLinear):
        return module
    if not isinstance(module, nn.Linear):
        raise AdapterIncompatible(f"the adapter targets {path}, a {type(module).__name__}; only Linear is supported")
    wrapped = LoraLinear(module)
    setattr(parent, child, wrapped)
    return wrapped
