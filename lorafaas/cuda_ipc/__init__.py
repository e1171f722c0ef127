"""Weight-sharing transports behind one export/attach API: sealed memfds on the CPU, CUDA VMM allocations on GPUs.

    export(state_dict, device) -> Export      copy tensors into one new sealed segment; `.manifest` describes it
    create(specs, device, name=...) -> Export an empty segment laid out for `specs`, to fill (e.g. from files)
    attach(manifest, fd) -> Attachment        the tensors as views on the segment in this process, no copy

A segment is one contiguous region (a sealed memfd on `cpu`, one exported cuMemCreate allocation on `cuda:N`) holding
every tensor at an aligned offset. What travels between processes is its `SegmentManifest` (transport tag, location,
tensor table) and, beside it over a Unix socket (SCM_RIGHTS), the segment's file descriptor (`Export.fd`): there is
no name to open. Attachers map it read-only on both device kinds, so a write faults the writer and nobody else.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from lorafaas.cuda_ipc.layout import DEFAULT_ALIGNMENT, TensorSpec, dtype_name, plan_layout
from lorafaas.cuda_ipc.messages import (
    FORMAT_VERSION,
    CudaVmmLocation,
    MemfdLocation,
    SegmentManifest,
    TensorEntry,
)
from lorafaas.errors import TransportUnavailable

if TYPE_CHECKING:
    import torch

__all__ = [
    "FORMAT_VERSION",
    "Attachment",
    "CudaVmmLocation",
    "Export",
    "MemfdLocation",
    "SegmentManifest",
    "TensorEntry",
    "TensorSpec",
    "attach",
    "check_device",
    "check_transport",
    "create",
    "export",
]


class Export(Protocol):
    """The owner's side of a segment; `fd` is the descriptor attachers need (owned by the export)."""

    manifest: SegmentManifest
    fd: int | None

    def writable_views(self) -> dict[str, torch.Tensor]: ...
    def read_spans(self, fd: int, file_offset: int, spans: Sequence[tuple[int, int]]) -> None: ...
    def seal(self) -> None: ...
    def destroy(self) -> None: ...


class Attachment(Protocol):
    """An attacher's side: `tensors` view the segment, which spans [base_ptr, base_ptr + size)."""

    manifest: SegmentManifest
    device: str
    base_ptr: int
    size: int
    tensors: dict[str, torch.Tensor]

    def contains(self, tensor: torch.Tensor) -> bool: ...
    def close(self) -> None: ...


def check_device(device: str) -> str:
    if device == "cpu":
        return device
    prefix, _, index = device.partition(":")
    if prefix == "cuda" and index.isdigit():
        return device
    raise TransportUnavailable(f"device {device!r} is not supported; use cpu or cuda:N")


def check_transport(device: str) -> None:
    """Fail early (TransportUnavailable) if `device`'s transport cannot run in this process."""
    if check_device(device) != "cpu":
        from lorafaas.cuda_ipc.cuda import require_cuda

        require_cuda(device)


def create(
    specs: Iterable[TensorSpec], device: str, *, name: str | None = None, alignment: int = DEFAULT_ALIGNMENT
) -> Export:
    """An empty, writable segment laid out for `specs` on `device`, its memory reserved (InsufficientMemory if it
    cannot be); `name` labels a CPU segment (the memfd's name in /proc/PID/maps)."""
    entries, size = plan_layout(specs, alignment)
    if check_device(device) == "cpu":
        from lorafaas.cuda_ipc.memfd import MemfdExport

        return MemfdExport(name or f"lorafaas-anon.{os.getpid()}.{secrets.token_hex(4)}", entries, size, alignment)
    from lorafaas.cuda_ipc.cuda import CudaExport

    return CudaExport(device, entries, size, alignment)


def export(state_dict: Mapping[str, torch.Tensor], device: str, *, name: str | None = None) -> Export:
    """Copy `state_dict` into one new sealed segment on `device` (tensors keep their dtype and shape)."""
    import torch

    specs = [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in state_dict.items()]
    segment = create(specs, device, name=name)
    try:
        views = segment.writable_views()
        with torch.no_grad():
            for tensor_name, tensor in state_dict.items():
                views[tensor_name].copy_(tensor)
        del views
        segment.seal()
    except BaseException:
        segment.destroy()
        raise
    return segment


def attach(manifest: SegmentManifest, fd: int) -> Attachment:
    """Map the segment of descriptor `fd`, described by `manifest` (both checked first), and return its tensors as
    views; nothing is copied. The caller keeps `fd` (it may close it right after: the mapping stays)."""
    if isinstance(manifest.location, MemfdLocation):
        from lorafaas.cuda_ipc.memfd import MemfdAttachment

        return MemfdAttachment(manifest, fd)
    from lorafaas.cuda_ipc.cuda import CudaAttachment

    return CudaAttachment(manifest, fd)
