"""Expert LoRA inside a function instance: the MoE forward with each expert's LoRA delta added, local or remote.

`install_expert_lora(model, source)` overrides the forward of every fused-experts module (transformers 5 Mixtral,
Qwen-MoE: `gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) with `ExpertLoraForward`, which per MoE layer

    sorts the routed rows by expert -> starts the gate/up delta round trip -> computes its own base gate/up GEMMs
    -> waits, adds the delta -> act(gate) * up -> starts the down delta round trip -> its own base down GEMMs
    -> waits, adds -> weights by the router and sums per token

so the round trip to a remote LoRA server overlaps the instance's base expert computation (InfiniLoRA). The delta
source is `LocalExpertLora` (the factors in this process, `--lora-mode local`) or `RemoteExpertLora` (a LoRA server
holds them, `--lora-mode remote`); both compute `B_e(A_e(x)) * scaling` with `lora_delta`, the same operations in the
same order as the server, so both modes give the same logits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from lorafaas.errors import AdapterIncompatible, InvalidInput
from lorafaas.formats.adapter_files import PEFT_PREFIX, WEIGHTS_FILE
from lorafaas.formats.expert_adapters import (
    ExpertAdapterInfo,
    ExpertFactors,
    load_expert_layer,
    read_expert_adapter_info,
)
from lorafaas.models.lora import HostAdapter, LoraWeights, owned_copy

log = logging.getLogger(__name__)

LoraMode = Literal["remote", "local"]
LORA_MODES: tuple[LoraMode, ...] = ("remote", "local")


def lora_delta(rows: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """B(A(rows)) * scaling: the operations and order of PEFT's LoRA layer (and of `LoraLinear`)."""
    return F.linear(F.linear(rows, a), b) * scaling


def grouped_lora_delta(rows: torch.Tensor, expert_counts: list[int], factors: ExpertFactors) -> torch.Tensor:
    """Deltas of rows sorted by expert (`expert_counts[e]` rows for expert e): one low-rank product per expert."""
    out = rows.new_empty(rows.shape[0], factors.b.shape[1])
    start = 0
    for expert, count in enumerate(expert_counts):
        if count:
            out[start : start + count] = lora_delta(
                rows[start : start + count], factors.a[expert], factors.b[expert], factors.scaling
            )
            start += count
    return out


class PendingDelta(Protocol):
    def wait(self) -> torch.Tensor:
        """The delta rows (valid until the next call on the same source)."""
        ...


class ExpertLoraSource(Protocol):
    def adapts(self, layer: int, projection: str) -> bool: ...

    def start(self, layer: int, projection: str, rows: torch.Tensor, expert_counts: list[int]) -> PendingDelta: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class _Ready:
    delta: torch.Tensor

    def wait(self) -> torch.Tensor:
        return self.delta


class LocalExpertLora:
    """The expert factors held in this process (`--lora-mode local`)."""

    def __init__(self, info: ExpertAdapterInfo, device: str = "cpu") -> None:
        self.info = info
        self.layers = {layer: load_expert_layer(info, layer, device) for layer in info.projections}

    @property
    def num_bytes(self) -> int:
        return sum(f.num_bytes for layer in self.layers.values() for f in layer.values())

    def adapts(self, layer: int, projection: str) -> bool:
        return projection in self.layers.get(layer, {})

    def start(self, layer: int, projection: str, rows: torch.Tensor, expert_counts: list[int]) -> PendingDelta:
        return _Ready(grouped_lora_delta(rows, expert_counts, self.layers[layer][projection]))

    def close(self) -> None:
        self.layers = {}


class RemoteExpertLora:
    """The expert factors held by a LoRA server (`--lora-mode remote`); this process keeps none of them."""

    def __init__(self, info: ExpertAdapterInfo, client, adapter_id: str) -> None:
        self.info = info
        self.client = client  # a LoraServerClient, already registered with `adapter_id`
        self.adapter_id = adapter_id
        self.num_bytes = 0

    def adapts(self, layer: int, projection: str) -> bool:
        return projection in self.info.projections.get(layer, ())

    def start(self, layer: int, projection: str, rows: torch.Tensor, expert_counts: list[int]) -> PendingDelta:
        return self.client.start_call(self.adapter_id, layer, projection, rows, expert_counts)

    def close(self) -> None:
        self.client.close()


class ExpertLoraForward:
    """The forward of one fused-experts module with its LoRA deltas added (see the module docstring)."""

    def __init__(self, experts: nn.Module, layer: int, source: ExpertLoraSource) -> None:
        self.experts: Any = experts  # a Mixtral experts block (num_experts, gate_up_proj, down_proj, act_fn)
        self.layer = layer
        self.source = source

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        experts, source, layer = self.experts, self.source, self.layer
        top_k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        expert_counts = torch.bincount(flat, minlength=experts.num_experts).tolist()
        token_idx, slot = order // top_k, order % top_k
        rows = hidden_states.index_select(0, token_idx)

        pending = (
            source.start(layer, "gate_up_proj", rows, expert_counts) if source.adapts(layer, "gate_up_proj") else None
        )
        gate_up = _expert_linear(rows, expert_counts, experts.gate_up_proj)  # overlaps the round trip
        if pending is not None:
            gate_up += pending.wait()
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = experts.act_fn(gate) * up

        pending = source.start(layer, "down_proj", hidden, expert_counts) if source.adapts(layer, "down_proj") else None
        out = _expert_linear(hidden, expert_counts, experts.down_proj)
        if pending is not None:
            out += pending.wait()
        out = out * top_k_weights[token_idx, slot, None]
        final = torch.zeros_like(hidden_states)
        final.index_add_(0, token_idx, out.to(final.dtype))
        return final


def _expert_linear(rows: torch.Tensor, expert_counts: list[int], weight: torch.Tensor) -> torch.Tensor:
    """Each expert's base projection of its rows; `weight` is the fused [experts, out, in] parameter."""
    out = rows.new_empty(rows.shape[0], weight.shape[1])
    start = 0
    for expert, count in enumerate(expert_counts):
        if count:
            out[start : start + count] = F.linear(rows[start : start + count], weight[expert])
            start += count
    return out


def fused_experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Module path -> fused-experts module, for every MoE layer this hook can serve."""
    found = {}
    for name, module in model.named_modules():
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3):
            continue
        if (
            getattr(module, "is_transposed", False)
            or not getattr(module, "is_concatenated", True)
            or getattr(module, "has_bias", False)
            or getattr(module, "has_post_expert_norm", False)
        ):
            raise AdapterIncompatible(
                f"{name}: {type(module).__name__} uses an expert layout expert adapters do "
                "not support (transposed, interleaved, biased or post-normed)"
            )
        found[name] = module
    return found


def install_expert_lora(model: nn.Module, source: ExpertLoraSource, info: ExpertAdapterInfo) -> int:
    """Route every adapted MoE layer's experts through `ExpertLoraForward`; returns the number of layers."""
    from lorafaas.formats.expert_adapters import layer_number

    remove_expert_lora(model)
    modules = fused_experts_modules(model)
    by_layer = {layer_number(path): (path, module) for path, module in modules.items()}
    for layer, experts_path in info.experts_paths.items():
        if layer not in by_layer or by_layer[layer][0] != experts_path:
            raise AdapterIncompatible(f"the adapter adapts {experts_path}, which the backbone does not have")
        module = by_layer[layer][1]
        if module.num_experts != info.num_experts:
            raise AdapterIncompatible(f"{experts_path} has {module.num_experts} experts, adapter {info.num_experts}")
        # An instance attribute: the module (and its shared parameters) stays where it is in the tree.
        module.forward = ExpertLoraForward(module, layer, source)
    return len(info.experts_paths)


def remove_expert_lora(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), ExpertLoraForward):
            del module.__dict__["forward"]


def read_attention_adapter(info: ExpertAdapterInfo) -> HostAdapter:
    """The non-expert (attention) part of an expert adapter, read alone: no expert tensor enters this process."""
    from safetensors import safe_open

    modules = {}
    with safe_open(str(Path(info.path) / WEIGHTS_FILE), framework="pt") as f:
        for module in info.attention_modules:
            name = f"{PEFT_PREFIX}{module}"
            modules[module] = LoraWeights(
                a=owned_copy(f.get_tensor(f"{name}.lora_A.weight"), torch.float32),
                b=owned_copy(f.get_tensor(f"{name}.lora_B.weight"), torch.float32), scaling=info.scaling,
            )
    return HostAdapter(path=Path(info.path), modules=modules)


@dataclass
class MoeAdapter:
    """An expert adapter opened by a function instance: its attention part and its expert-delta source."""

    info: ExpertAdapterInfo
    mode: LoraMode
    attention: HostAdapter
    source: ExpertLoraSource
    held_bytes: int = field(default=0)  # adapter tensor bytes this process holds

    def close(self) -> None:
        self.source.close()


def open_moe_adapter(
    adapter_dir: Path,
    mode: LoraMode | None,
    *,
    lora_server: str | None = None,
    client: str = "",
    device: str = "cpu",
) -> MoeAdapter:
    """Open an expert adapter in `mode` (None: remote, the default on MoE backbones)."""
    mode = mode or "remote"
    if mode not in LORA_MODES:
        raise InvalidInput(f"lora mode is {mode!r}; expected one of {', '.join(LORA_MODES)}")
    info = read_expert_adapter_info(adapter_dir)
    attention = read_attention_adapter(info)
    if mode == "local":
        source = LocalExpertLora(info, device)
        return MoeAdapter(info, mode, attention, source, attention.num_bytes + source.num_bytes)
    if not lora_server:
        raise InvalidInput(
            f"adapter {adapter_dir} has expert factors and runs in remote mode (the default on MoE backbones), but "
            "no LoRA server was given; start one with `lorafaas moe serve` and pass its address, or use "
            "--lora-mode local"
        )
    from lorafaas.protocols.lora_transport import LoraServerClient

    server = LoraServerClient.connect(lora_server, client=client)
    try:
        adapter_id = str(Path(adapter_dir).resolve())
        server.register(adapter_id, adapter_id)
    except BaseException:
        server.close()
        raise
    return MoeAdapter(info, mode, attention, RemoteExpertLora(info, server, adapter_id), attention.num_bytes)
