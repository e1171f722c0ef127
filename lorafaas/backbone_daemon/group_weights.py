"""The backbone's tensors of each base-pass group (`lorafaas.protocols.base_pass.GroupSpec`), resolved in the
segment and checked against it, and the group's products computed from them: the kernels of the base-pass executor
(`lorafaas.backbone_daemon.base_pass`), which feeds them its members' rows and writes back their outputs.

By default the segment holds the linear weights in oneDNN's blocked layout already (`lorafaas.models.packed_weights`)
and the products come from oneDNN's views of them. A segment left plain (`LORAFAAS_CPU_LINEAR=torch|onednn`) on a bf16
backbone, where oneDNN computes bf16 natively (AVX-512 BF16), is computed from a private packed copy instead
(`pack_if_bf16`, made when the first member joins and dropped by `unpack` when the last leaves; one thread): the
outputs are the same bit for bit (docs/performance.md, "Packed weights in the segment").

A gated MLP group (`GroupSpec.mlp_down`) and a layer tail (`GroupSpec.tail`) are computed as the model family
computes them (`lorafaas.models.families.llama`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lorafaas.cuda_ipc.layout import dtype_name
from lorafaas.models.families.llama import gated_mlp, layer_tail, rms_norm
from lorafaas.protocols import base_pass as bp

log = logging.getLogger(__name__)
PACK_BATCH_HINT = 8  # rows a round usually has (eight one-row functions): oneDNN picks its blocking for it

Layer = list[tuple[torch.Tensor, torch.Tensor | None]]  # a group's (weight, bias) pairs


def packs_bf16() -> bool:
    """Whether oneDNN computes bf16 products natively on this CPU (else a packed copy would only cost memory)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a weight packed by `torch.ops.mkldnn._reorder_linear_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@dataclass(frozen=True)
class TailWeights:
    """A layer tail's tensors (`bp.LayerTail`), resolved in the segment."""

    o_proj: torch.Tensor
    post_norm: torch.Tensor
    mlp: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # gate, up, down
    next_norm: torch.Tensor
    eps: float


class GroupWeights:
    """Each group's tensors and its products. Raises ValueError when the groups do not fit the tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor], groups: tuple[bp.GroupSpec, ...],
                 linear: Callable[..., torch.Tensor]) -> None:
        self.tensors = tensors
        self.groups = groups
        self.linear = linear  # the kernel of the products from the segment's weights
        self._linear: Callable[..., torch.Tensor] = linear
        self._layers: list[Layer] = []
        self._downs: list[torch.Tensor | None] = []  # per group: a gated MLP's down weight, else None
        self._tails: list[TailWeights | None] = []  # per group: a layer tail's tensors, else None
        self.first_tail = 0  # the first tail group (len(groups) without tails)
        self.unpack()

    @property
    def num_groups(self) -> int:
        return len(self._layers)

    @property
    def dtype(self) -> torch.dtype | None:
        """The backbone's weights' dtype (None without groups)."""
        return self._layers[0][0][0].dtype if self._layers else None

    @property
    def has_tails(self) -> bool:
        return self.first_tail < len(self._layers)

    @property
    def packed(self) -> bool:
        """The products come from a packed copy of the weights (`pack_if_bf16`)."""
        return self._linear is packed_linear

    def layer(self, key: int) -> Layer:
        """Group `key`'s (weight, bias) pairs, in the layout computed from now (packed or the segment's)."""
        return self._layers[key]

    def is_gated_mlp(self, key: int) -> bool:
        return self._downs[key] is not None

    def in_width(self, key: int) -> int:
        tail = self._tails[key]
        if tail is not None:  # the attention's output, the residual and the o_proj delta (float32)
            return bp.tail_in_width(tail.o_proj.shape[1], tail.o_proj.shape[0], dtype_name(tail.o_proj.dtype))
        return self._layers[key][0][0].shape[1]

    def out_width(self, key: int) -> int:
        down, tail = self._downs[key], self._tails[key]
        if down is not None:
            return down.shape[0]
        products = sum(w.shape[0] for w, _ in self._layers[key])
        return products + 2 * tail.o_proj.shape[0] if tail is not None else products

    def weights_of(self, key: int) -> list[torch.Tensor]:
        """The weights a call of group `key` reads, in the layout computed from now."""
        down, tail = self._downs[key], self._tails[key]
        found = [weight for weight, _ in self._layers[key]] + ([] if down is None else [down])
        return found if tail is None else [tail.o_proj, *tail.mlp, *found]

    def num_products(self, key: int) -> int:
        """The products a call of group `key` computes (a tail's o_proj and MLP count four)."""
        return len(self._layers[key]) + (self._downs[key] is not None) + 4 * (self._tails[key] is not None)

    # -- products ---------------------------------------------------------------------------------------------------

    def compute(self, key: int, x: torch.Tensor) -> list[torch.Tensor]:
        """Group `key`'s outputs for the rows x [rows, in_width(key)], in the order a member reads them."""
        layer, down, tail = self._layers[key], self._downs[key], self._tails[key]
        if tail is not None:
            return self._tail(tail, layer, x)
        if down is None:
            return [self._linear(x, weight, bias) for weight, bias in layer]
        # the gated MLP, as the model family computes it: down(silu(gate(x)) * up(x))
        return [gated_mlp(self._linear, x, layer[0][0], layer[1][0], down)]

    def _tail(self, tail: TailWeights, layer: Layer, x: torch.Tensor) -> list[torch.Tensor]:
        """A layer tail's outputs for X = [attention output, residual, o_proj delta in float32]
        (`bp.GroupSpec.tail`)."""
        attended_width, hidden_width = tail.o_proj.shape[1], tail.o_proj.shape[0]
        delta_width = hidden_width * bp.delta_elements(dtype_name(x.dtype))
        attended, residual, delta = x.split([attended_width, hidden_width, delta_width], dim=1)
        if delta.dtype != torch.float32:  # the float32 values' bytes, in X's elements
            delta = delta.contiguous().view(torch.float32)
        hidden = layer_tail(self._linear, attended, residual, delta, tail.o_proj, tail.post_norm, tail.eps, tail.mlp)
        normed = rms_norm(tail.next_norm, tail.eps, hidden)
        return [hidden, normed, *(self._linear(normed, weight, bias) for weight, bias in layer)]

    # -- layouts ----------------------------------------------------------------------------------------------------

    def unpack(self) -> None:
        """The segment's tensors of each group, in their plain layout (`pack_if_bf16` packs them)."""
        groups = self.groups
        layers = [self._resolve(group) for group in groups]
        downs = [self._resolve_down(group, layer) for group, layer in zip(groups, layers, strict=True)]
        tails = [self._resolve_tail(group, layer) for group, layer in zip(groups, layers, strict=True)]
        first_tail = next((key for key, tail in enumerate(tails) if tail is not None), len(tails))
        if first_tail == 0 or any(tail is None for tail in tails[first_tail:]):
            raise ValueError("layer tails must come after every other group (a pass starts at group 0)")
        self._layers, self._downs, self._tails, self.first_tail = layers, downs, tails, first_tail
        self._linear = self.linear

    def pack_if_bf16(self) -> bool:
        """On a bf16 backbone, compute from a packed copy of its weights (module docstring); whether it did."""
        if self.dtype != torch.bfloat16 or self._layers[0][0][0].is_mkldnn:  # (packed in the segment already)
            return False
        started = time.monotonic()
        packed: dict[int, torch.Tensor] = {}  # by the segment's address: a weight in two groups is packed once

        def pack(weight: torch.Tensor) -> torch.Tensor:
            if weight.data_ptr() not in packed:
                packed[weight.data_ptr()] = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
            return packed[weight.data_ptr()]

        try:
            layers = [[(pack(weight), bias) for weight, bias in layer] for layer in self._layers]
            downs = [None if down is None else pack(down) for down in self._downs]
            tails = [None if tail is None else dataclasses.replace(
                tail, o_proj=pack(tail.o_proj), mlp=(pack(tail.mlp[0]), pack(tail.mlp[1]), pack(tail.mlp[2])))
                for tail in self._tails]
        except RuntimeError as exc:  # oneDNN refused a shape: the plain layout computes the same
            log.warning("base pass: bf16 weights not packed (%s); computing from the segment's layout", exc)
            return False
        self._layers, self._downs, self._tails = layers, downs, tails
        self._linear = packed_linear
        size = sum(w.numel() * w.element_size() for w in packed.values())
        log.info("base pass: bf16 weights packed for oneDNN (%.0f MB, %.2f s)", size / 1e6, time.monotonic() - started)
        return True

    def _resolve_tail(self, group: bp.GroupSpec, layers: Layer) -> TailWeights | None:
        spec = group.tail
        if spec is None:
            return None
        if group.mlp_down is not None:
            raise ValueError("a group is a gated MLP or a layer tail, not both")

        def tensor(name: str, dim: int) -> torch.Tensor:
            found = self.tensors.get(name)
            if found is None or found.dim() != dim:
                raise ValueError(f"the backbone has no {dim}-D tensor {name!r} for a layer tail")
            return found

        o_proj, gate, up, down = (tensor(n, 2) for n in (spec.o_proj, spec.gate, spec.up, spec.down))
        post_norm, next_norm = tensor(spec.post_norm, 1), tensor(spec.next_norm, 1)
        hidden = o_proj.shape[0]
        if not (post_norm.shape[0] == next_norm.shape[0] == gate.shape[1] == up.shape[1] == down.shape[0] == hidden
                and gate.shape[0] == up.shape[0] == down.shape[1]):
            raise ValueError(f"the layer tail of {spec.o_proj!r} does not fit the backbone's shapes")
        if any(w.shape[1] != hidden for w, _ in layers):
            raise ValueError(f"the products after the layer tail of {spec.o_proj!r} do not take its width")
        if not 0 < spec.eps < 1:
            raise ValueError(f"a layer tail's eps is {spec.eps}")
        return TailWeights(o_proj=o_proj, post_norm=post_norm, mlp=(gate, up, down), next_norm=next_norm,
                           eps=spec.eps)

    def _resolve_down(self, group: bp.GroupSpec, layers: Layer) -> torch.Tensor | None:
        if group.mlp_down is None:
            return None
        down = self.tensors.get(group.mlp_down)
        if len(layers) != 2 or any(bias is not None for _, bias in layers):
            raise ValueError("a gated MLP group takes two weights (gate and up) and no biases")
        if down is None or down.dim() != 2 or down.shape[1] != layers[0][0].shape[0] \
                or layers[1][0].shape[0] != layers[0][0].shape[0]:
            raise ValueError(f"the backbone has no down weight {group.mlp_down!r} fitting its gate and up")
        return down

    def _resolve(self, group: bp.GroupSpec) -> Layer:
        if not group.weights or len(group.weights) != len(group.biases):
            raise ValueError("a group needs its weights and one bias entry per weight")
        layers: Layer = []
        for weight_name, bias_name in zip(group.weights, group.biases, strict=True):
            weight = self.tensors.get(weight_name)
            if weight is None or weight.dim() != 2:
                raise ValueError(f"the backbone has no linear weight {weight_name!r}")
            bias = None
            if bias_name is not None:
                bias = self.tensors.get(bias_name)
                if bias is None or bias.shape != (weight.shape[0],):
                    raise ValueError(f"the backbone has no bias {bias_name!r} for {weight_name!r}")
            if layers and weight.shape[1] != layers[0][0].shape[1]:
                raise ValueError(f"{weight_name!r} takes another input width than its group's first weight")
            layers.append((weight, bias))
        return layers
