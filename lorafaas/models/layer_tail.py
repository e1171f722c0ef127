"""The part of a Llama-family decoder layer after attention, as the model computes it: one definition used by a
function's own decode step and by the base-pass executor computing it for the function (a layer tail,
`lorafaas.protocols.base_pass.GroupSpec.tail`), so the two give the same numbers."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def rms_norm(weight: torch.Tensor, eps: float, hidden: torch.Tensor) -> torch.Tensor:
    """`LlamaRMSNorm.forward`'s operations, in its order and dtypes."""
    dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(dtype)


def gated_mlp(linear: Callable[..., torch.Tensor], x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
              down: torch.Tensor) -> torch.Tensor:
    """`LlamaMLP.forward` with a SiLU and no biases: down(silu(gate(x)) * up(x))."""
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)


def layer_tail(linear: Callable[..., torch.Tensor], attended: torch.Tensor, hidden: torch.Tensor,
               o_delta: torch.Tensor, o_proj: torch.Tensor, post_norm: torch.Tensor, eps: float,
               mlp: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The residual stream after a layer's o_proj (its LoRA delta added as `LoraLinear` adds it) and its MLP."""
    o = linear(attended, o_proj)
    hidden = hidden + (o + o_delta).to(o.dtype)
    return hidden + gated_mlp(linear, rms_norm(post_norm, eps, hidden), *mlp)
