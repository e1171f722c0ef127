"""Which kernel computes a backbone's linear products on a CPU: oneDNN from weights packed in the segment
(`PackedLinear`, lorafaas/models/packed_weights.py: the default), else torch's BLAS or oneDNN from the plain layout,
as measured here.

`F.linear` in float32 goes to the BLAS torch was built with (MKL). On some CPUs that is far from the memory's speed at
the one to eight rows of a decode step: on an AMD EPYC with AVX-512, MKL's pass over SmolLM2's 538 MB took 51-65 ms
on one or two threads, where oneDNN computing from the same plain row-major weights took 47 ms on one thread and
28-32 ms on two, and from the packed layout less again (docs/performance.md, "Packed weights in the segment"). bf16
products already go to oneDNN in torch.

The choice is measured once, by the backbone's daemon when it loads the segment (`choose_cpu_linear`), and handed to
every function attached to it (`BackboneInfo.cpu_linear`), so all instances of a backbone compute alike; a function
applies it with `use_onednn_linears`. oneDNN's results differ from the BLAS's by float32 roundings (about 1e-6
relative), as a row's product in a batch of other rows already does.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TypeGuard

import torch
import torch.nn.functional as F
from torch import nn

ONEDNN_MIN_SPEEDUP = 1.1  # below this, keep the BLAS: the measurement's noise, and the results stay the BLAS's
CALIBRATION_BYTES = 32 << 20  # of the layers' weights, plus a slice of the widest (the LM head's shape)
CALIBRATION_HEAD_ROWS = 8192
CALIBRATION_ROUNDS = 3
CALIBRATION_ROWS = (1, 2, 3, 4)  # the steps of one to a few requests, where BLAS kernels differ most


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available()


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear computed by oneDNN from the plain weight. No autograd: for inference only."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


LINEAR_KERNELS = {"torch": F.linear, "onednn": onednn_linear}  # a choice's name -> F.linear's signature


class OneDnnLinear(nn.Linear):
    """An nn.Linear (same parameters, same state dict, `isinstance` holds) whose inference forward is oneDNN's.
    With gradients wanted it computes as nn.Linear does: oneDNN's op has no backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return F.linear(x, self.weight, self.bias)
        return onednn_linear(x, self.weight, self.bias)


class PackedLinear(nn.Linear):
    """A backbone's nn.Linear whose weight lies in the segment in oneDNN's blocked layout
    (lorafaas/models/packed_weights.py): `packed` is oneDNN's view of it, and products come from that. `weight` is
    the same bytes as a plain tensor, for its shape, dtype and address only: its values are not in order. Inference
    only."""

    packed: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError("a backbone packed for oneDNN computes inference only")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def is_bare_linear(module: object) -> TypeGuard[nn.Linear]:
    """A backbone's plain linear layer, whichever kernel computes it (not a subclass that changes what it computes,
    not an adapter's wrapper)."""
    return type(module) in (nn.Linear, OneDnnLinear, PackedLinear)


def use_onednn_linears(model: nn.Module) -> int:
    """Make every plain float32 CPU nn.Linear of `model` a OneDnnLinear (in place); the number changed."""
    changed = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu":
            module.__class__ = OneDnnLinear
            changed += 1
    return changed


@dataclass(frozen=True)
class CpuLinearChoice:
    kernel: str  # "torch" or "onednn"
    reason: str  # for the daemon's log


def choose_cpu_linear(setting: str, weights: list[torch.Tensor]) -> CpuLinearChoice:
    """The kernel for float32 products over `weights` (a backbone's 2-D weights, in order): `setting` "torch" or
    "onednn" as given (oneDNN only if torch has it), "auto" measured here on one thread (`_measure`)."""
    matrices = [w for w in weights if w.dim() == 2 and w.dtype == torch.float32 and w.device.type == "cpu"]
    if setting == "torch":
        return CpuLinearChoice("torch", "set")
    if not matrices:
        return CpuLinearChoice("torch", "no float32 CPU weights")
    if not onednn_available():
        return CpuLinearChoice("torch", "this torch has no oneDNN")
    if setting == "onednn":
        return CpuLinearChoice("onednn", "set")
    return _measure(matrices)


def _measure(matrices: list[torch.Tensor]) -> CpuLinearChoice:
    # the layers' own shapes, and a slice of the widest matrix (the LM head's, or the embedding tied to it)
    widest = max(matrices, key=lambda w: w.shape[0])
    sample, size = [widest[:CALIBRATION_HEAD_ROWS]], 0
    for weight in matrices:
        if weight is widest:
            continue
        sample.append(weight)
        size += weight.numel() * weight.element_size()
        if size >= CALIBRATION_BYTES:
            break
    size += sample[0].numel() * sample[0].element_size()
    inputs = {(rows, w.shape[1]): torch.ones(rows, w.shape[1]) for rows in CALIBRATION_ROWS for w in sample}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a busy function's step computes on one thread (the step gate's compute slots)
    try:
        with torch.inference_mode():
            times: dict[str, list[float]] = {kernel: [] for kernel in LINEAR_KERNELS}
            for round_ in range(CALIBRATION_ROUNDS + 1):  # the first is a warm-up (oneDNN makes its primitives)
                for kernel, linear in LINEAR_KERNELS.items():
                    started = time.perf_counter()
                    for rows in CALIBRATION_ROWS:
                        for weight in sample:
                            linear(inputs[rows, weight.shape[1]], weight)
                    if round_:
                        times[kernel].append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    blas, onednn = statistics.median(times["torch"]), statistics.median(times["onednn"])
    kernel = "onednn" if blas >= ONEDNN_MIN_SPEEDUP * onednn else "torch"
    reason = (f"one thread, {size / 1e6:.0f} MB at {CALIBRATION_ROWS[0]} to {CALIBRATION_ROWS[-1]} rows: "
              f"torch {blas * 1e3:.1f} ms, oneDNN {onednn * 1e3:.1f} ms")
    return CpuLinearChoice(kernel, reason)
