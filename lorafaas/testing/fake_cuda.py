"""Make FakeTensorMode's `cuda:0` tensors fully usable on a CPU-only build of torch, for the GPU-correctness tier.

FakeTensorMode creates tensors on `cuda:0` without a GPU, but on a build without CUDA, Python indexing (`t[1:]`,
`t[None]`, `t[idx] = v`) opens a device guard for the tensor's device first, and no guard is registered for CUDA:
"PyTorch is not linked with support for cuda devices". c10 ships a guard for exactly this (`FakeGuardImpl`, which
only tracks a current device index); this module compiles a ten-line extension that registers it for CUDA. Nothing
runs on a device: every tensor in the tier is fake. On a build with CUDA it does nothing (the real guard exists).

`fake_cuda_mode()` is FakeTensorMode plus one more allowance for such a build: `torch.tensor(data, device="cuda:0")`
builds the data on the CPU and copies it with the Python dispatch key excluded, so the copy meets the missing CUDA
kernels; inside the mode it becomes a fake tensor of the data's shape and dtype on the device (fake tensors carry no
data). A call without `device=` still makes a CPU tensor, which is what the tier catches.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

_SOURCE = """
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>
#include <torch/extension.h>

C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);

bool installed() { return c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("installed", &installed); }
"""


@functools.cache
def install_fake_cuda_guard() -> None:
    """Register c10's FakeGuardImpl for CUDA in this process (once); raises if the extension cannot be built."""
    import torch

    if torch.backends.cuda.is_built():
        return
    from torch.utils.cpp_extension import load_inline

    module = load_inline(name="lorafaas_fake_cuda_guard", cpp_sources=[_SOURCE], verbose=False)
    if not module.installed():
        raise RuntimeError("the fake CUDA device guard did not register")


@contextlib.contextmanager
def fake_cuda_mode() -> Iterator[object]:
    """FakeTensorMode in which `cuda:0` tensors work on a CPU-only torch (see the module's docstring)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    install_fake_cuda_guard()
    original = torch.tensor

    def tensor(data, *args, device=None, **kwargs):
        made = original(data, *args, **kwargs)  # a fake CPU tensor (a constant: copying it would run for real)
        if device is None or torch.device(device).type == "cpu":
            return made
        return torch.empty(made.shape, dtype=made.dtype, device=device)  # fake tensors hold no data anyway

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        if not torch.backends.cuda.is_built():
            torch.tensor = tensor
        try:
            yield mode
        finally:
            torch.tensor = original
