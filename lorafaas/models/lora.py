"""Unmerged LoRA beside a shared, read-only backbone.

The backbone's linear layers are wrapped, never modified: `LoraLinear` computes `base(x) + B(A(x)) * scaling` with the
same operations, in the same order, as PEFT's LoRA layer, so outputs equal PEFT's bit for bit. Loading is a
safetensors read (memory-mapped) plus a few dozen attribute assignments, far faster than `PeftModel.from_pretrained`.

An adapter moves through the tiers the scheduler reasons about: `HostAdapter` (read into host memory), placed on the
device (`attach_adapter`), offloaded back (`detach_adapter`, keeps the host copy), dropped (forget the HostAdapter).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lorafaas.errors import AdapterIncompatible
from lorafaas.formats.adapter_files import WEIGHTS_FILE, read_adapter
from lorafaas.formats.adapter_rules import AdapterLayout, ModuleSlot, ModuleTable, check_against_model
from lorafaas.models.cpu_linear import is_bare_linear


@dataclass(frozen=True)
class LoraWeights:
    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]
    scaling: float
    bias: torch.Tensor | None = None  # [out_features]: PEFT's lora_bias (lora_B has a bias)


@dataclass(frozen=True)
class HostAdapter:
    """An adapter read into host memory: module path -> LoRA weights, and the modules it replaces whole."""

    path: Path
    modules: dict[str, LoraWeights]
    saved: dict[str, torch.Tensor] = field(default_factory=dict)  # "<module>.<parameter>" (modules_to_save)
    # The adapter's config and layout, checked against the model it is attached to by the rules deploy applied.
    config: dict | None = None
    layout: AdapterLayout | None = None

    @property
    def num_bytes(self) -> int:
        lora = sum(w.a.nbytes + w.b.nbytes + (w.bias.nbytes if w.bias is not None else 0)
                   for w in self.modules.values())
        return lora + sum(t.nbytes for t in self.saved.values())


def read_host_adapter(path: Path) -> HostAdapter:
    """Read and check a PEFT LoRA adapter into host memory (no model needed).

    Every factor is float32 whatever its dtype in the file, as PEFT's load_state_dict copies it into float32 layers,
    and is a copy of its own (`owned_copy`).
    """
    from safetensors.torch import load_file

    info = read_adapter(path)
    tensors = load_file(Path(path) / WEIGHTS_FILE)
    modules = {
        module: LoraWeights(
            a=owned_copy(tensors[entry.a], torch.float32),
            b=owned_copy(tensors[entry.b], torch.float32),
            scaling=entry.scaling,
            bias=owned_copy(tensors[entry.bias], torch.float32) if entry.bias else None,
        )
        for module, entry in info.layout.loras.items()
    }
    saved = {key: owned_copy(tensors[name]) for key, name in info.layout.tensor_names.items()}
    return HostAdapter(path=Path(path), modules=modules, saved=saved, config=info.config, layout=info.layout)


def owned_copy(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A copy in memory of its own. A tensor `load_file` returns may sit at any 8-byte offset of the file's buffer,
    and a CPU GEMM's result can depend on its operands' alignment (a float32 product on AVX-512 differs in the last
    bit): PEFT copies the factors into fresh (64-byte aligned) parameters, so do the same to compute what it does."""
    return tensor.to(dtype or tensor.dtype, copy=True)


def module_table(model: nn.Module) -> ModuleTable:
    """What PEFT's matching sees of `model` (its own modules, through the wrappers this module adds)."""
    modules: dict[str, ModuleSlot] = {}

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            base = child.base if isinstance(child, (LoraLinear, SavedModule)) else child
            children = list(base.named_children())
            modules[path] = ModuleSlot(
                kind="Linear" if is_bare_linear(base) else type(base).__name__,
                in_features=getattr(base, "in_features", 0) if isinstance(base, nn.Linear) else 0,
                out_features=getattr(base, "out_features", 0) if isinstance(base, nn.Linear) else 0,
                parameters={n: tuple(p.shape) for n, p in base.named_parameters(recurse=False)},
                is_leaf=not children,
            )
            visit(path + ".", base)

    visit("", model)
    get_output_embeddings = getattr(model, "get_output_embeddings", None)  # a transformers model's
    output = get_output_embeddings() if get_output_embeddings is not None else None
    output_name = next((n for n, m in model.named_modules() if output is not None and m is output), None)
    if output_name is not None and output_name.endswith(".base"):  # lm_head already wrapped by a LoraLinear
        output_name = output_name.removesuffix(".base")
    return ModuleTable(modules=modules, output_layer=output_name)


class LoraLinear(nn.Module):
    """A linear layer of the shared backbone with an optional private LoRA beside it."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.lora_a: torch.Tensor | None = None
        self.lora_b: torch.Tensor | None = None
        self.lora_bias: torch.Tensor | None = None
        self.scaling = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base(x)
        if self.lora_a is None:
            return result
        # Same operations and order as peft.tuners.lora.Linear.forward:
        # result + lora_B(lora_A(x)) * scaling, in the adapter's dtype, cast back to the result's.
        return (result + self.delta(x)).to(result.dtype)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The LoRA's part of the output for x, in the adapter's dtype (an adapter must be attached)."""
        if self.lora_a is None or self.lora_b is None:
            raise RuntimeError("no adapter is attached to this layer")
        return F.linear(F.linear(x.to(self.lora_a.dtype), self.lora_a), self.lora_b, self.lora_bias) * self.scaling


class SavedModule(nn.Module):
    """A backbone module that an adapter may replace whole (PEFT's modules_to_save) by a private copy."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base
        self.replacement: nn.Module | None = None

    def forward(self, *args, **kwargs):
        return (self.base if self.replacement is None else self.replacement)(*args, **kwargs)


def attach_adapter(model: nn.Module, adapter: HostAdapter, device: torch.device | str = "cpu") -> int:
    """Place the adapter's weights on `device` beside the model's layers; returns the bytes placed.

    Replaces any adapter attached before. Checks the adapter against the model with the rules deploy applied
    (`rules.check_against_model`), so what deployed attaches; raises AdapterIncompatible if shapes disagree.
    """
    detach_adapter(model)
    _changed(model)
    if adapter.config is not None and adapter.layout is not None:
        check_against_model(adapter.config, adapter.layout, module_table(model))
    placed = 0
    for path, weights in adapter.modules.items():
        layer = _wrapped(model, path, LoraLinear)
        base = layer.base
        if weights.a.shape[1] != base.in_features or weights.b.shape[0] != base.out_features:
            raise AdapterIncompatible(
                f"shape mismatch at {path}: the adapter maps {weights.a.shape[1]} -> {weights.b.shape[0]} features, "
                f"the backbone {base.in_features} -> {base.out_features}"
            )
        layer.lora_a = weights.a.to(device, non_blocking=True)
        layer.lora_b = weights.b.to(device, non_blocking=True)
        layer.lora_bias = weights.bias.to(device, non_blocking=True) if weights.bias is not None else None
        layer.scaling = weights.scaling
        placed += weights.a.nbytes + weights.b.nbytes + (weights.bias.nbytes if weights.bias is not None else 0)
    replaced: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in adapter.saved.items():
        module, _, parameter = key.rpartition(".")
        replaced.setdefault(module, {})[parameter] = tensor
    for path, parameters in replaced.items():
        holder = _wrapped(model, path, SavedModule)
        # A shallow copy shares the base's code, buffers and settings; only its parameters are the adapter's, cast
        # to the base's dtype as PEFT's ModulesToSaveWrapper (a deep copy loaded with load_state_dict) has them.
        replacement = copy.copy(holder.base)
        replacement._parameters = {
            name: None if p is None else nn.Parameter(parameters[name].to(device=device, dtype=p.dtype),
                                                      requires_grad=False)
            for name, p in holder.base._parameters.items()
        }
        holder.replacement = replacement
        placed += sum(t.nbytes for t in parameters.values())
    return placed


def detach_adapter(model: nn.Module) -> None:
    """Remove the adapter from the device; the model computes the plain backbone again."""
    _changed(model)
    for module in model.modules():
        if isinstance(module, LoraLinear):
            module.lora_a = module.lora_b = module.lora_bias = None
            module.scaling = 0.0
        elif isinstance(module, SavedModule):
            module.replacement = None


def adapter_version(model: nn.Module) -> int:
    """A number that changes whenever an adapter is attached to or detached from `model` (what is checked against
    its modules, like the base pass's layer tails, can be kept until then)."""
    return model.__dict__.get("_lorafaas_adapter_version", 0)


def _changed(model: nn.Module) -> None:
    model.__dict__["_lorafaas_adapter_version"] = adapter_version(model) + 1


def _wrapped(model: nn.Module, path: str, wrapper: type[LoraLinear] | type[SavedModule]):
    parent_path, _, child = path.rpartition(".")
    try:
        parent = model.get_submodule(parent_path) if parent_path else model
        module = getattr(parent, child)
    except AttributeError as exc:
        raise AdapterIncompatible(f"the adapter targets {path}, which the backbone does not have") from exc
    if isinstance(module, wrapper):
        return module
    if wrapper is LoraLinear and not isinstance(module, nn.Linear):
        raise AdapterIncompatible(f"the adapter targets {path}, a {type(module).__name__}; only Linear is supported")
    wrapped = wrapper(module)
    setattr(parent, child, wrapped)
    return wrapped
