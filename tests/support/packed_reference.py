"""A private model computing as a default daemon's functions do: each linear weight the daemon's loader packs for
oneDNN (`lorafaas.models.packed_weights`) packed here from the model's own copy, by oneDNN directly. A function bound
to a packed segment must give these logits bit for bit: its packed bytes are what oneDNN made, where the loader put
them."""

from __future__ import annotations

import torch
from torch import nn

from lorafaas.models.binding import tied_weight_keys
from lorafaas.models.cpu_linear import PackedLinear
from lorafaas.models.packed_weights import PACK_ROWS, linear_weight_names, packable


def packed_like_the_daemon(model: nn.Module) -> nn.Module:
    """`model` (a private load), its packable linear layers made `PackedLinear`s in place; returns it."""
    tied = tied_weight_keys(model)
    names = linear_weight_names(model, set(tied) | set(tied.values()))
    for path, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if f"{path}.weight" not in names or weight is None or not packable(str(weight.dtype).removeprefix("torch.")):
            continue
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
        if torch.ops.mkldnn._nbytes(packed) != weight.numel() * weight.element_size():
            continue  # padded: the loader leaves it plain
        module.__class__ = PackedLinear
        module.packed = packed
    return model
