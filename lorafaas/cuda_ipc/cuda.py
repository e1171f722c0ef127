"""The GPU transport: one device allocation per segment, shared with CUDA IPC through cupy; tensors via DLPack.

The owner allocates the segment with `cudaMalloc` directly (not from a memory pool, so the IPC handle's base is the
segment's base), fills it, and exports one `cudaIpcMemHandle_t` for all of it. An attacher opens the handle
(`cudaIpcOpenMemHandle`), wraps the pointer as a cupy array that does not own it, turns that into a torch tensor with
DLPack and slices the tensors out of it; `close` drops the views and closes the handle. cupy is imported lazily, so
machines without a GPU never need it. A handle cannot be opened in the process that created it (a CUDA rule), so
attachers are always other processes. CUDA IPC has no read-only mapping: on a GPU, "functions never write the
backbone" is kept by the runtime (parameters without gradients, inference mode), not by the MMU.
"""

from __future__ import annotations

import os

from lorafaas.cuda_ipc.layout import check_manifest, segment_contains, tensor_views
from lorafaas.cuda_ipc.messages import CudaIpcLocation, SegmentManifest, TensorEntry
from lorafaas.errors import SegmentError, TransportUnavailable

STAGING_BYTES = 64 * 1024 * 1024  # host buffer for file -> device copies


def require_cupy():
    """cupy, once it is known to see a CUDA device; TransportUnavailable otherwise."""
    try:
        import cupy
    except ImportError as exc:
        raise TransportUnavailable(
            "CUDA devices need cupy for CUDA IPC: install lorafaas[gpu] (cupy-cuda12x) on a machine with a GPU"
        ) from exc
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as exc:  # no driver
        raise TransportUnavailable(f"cupy is installed but CUDA is not usable: {exc}") from exc
    if count == 0:
        raise TransportUnavailable("cupy is installed but sees no CUDA device")
    return cupy


def device_index(device: str) -> int:
    prefix, _, index = device.partition(":")
    if prefix != "cuda" or not index.isdigit():
        raise TransportUnavailable(f"device {device!r} is not a CUDA device; expected cuda:N")
    return int(index)


def _as_torch(cupy, ptr: int, size: int, index: int, owner: object):
    """A flat uint8 torch tensor over device memory this code does not own (DLPack, no copy)."""
    import torch

    memory = cupy.cuda.UnownedMemory(ptr, size, owner, index)
    array = cupy.ndarray((size,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
    return torch.from_dlpack(array)


class CudaExport:
    """The owner's side: one cudaMalloc'ed segment, its IPC handle, filling and freeing."""

    def __init__(self, device: str, entries: tuple[TensorEntry, ...], size: int, alignment: int) -> None:
        cupy = require_cupy()
        self._cupy = cupy
        self.index = device_index(device)
        with cupy.cuda.Device(self.index):
            self._ptr: int | None = cupy.cuda.runtime.malloc(size)
            try:
                handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(self._ptr))
            except cupy.cuda.runtime.CUDARuntimeError:
                cupy.cuda.runtime.free(self._ptr)
                raise
        self.manifest = SegmentManifest(
            device=device,
            location=CudaIpcLocation(handle=handle, device_index=self.index, owner_pid=os.getpid()),
            size=size,
            alignment=alignment,
            tensors=entries,
        )
        self._base = _as_torch(cupy, self._ptr, size, self.index, self)
        self._staging = None

    def writable_views(self) -> dict:
        if self._base is None:
            raise SegmentError("the CUDA segment was destroyed")
        return tensor_views(self._base, self.manifest.tensors)

    def read_from_file(self, segment_offset: int, nbytes: int, fd: int, file_offset: int) -> None:
        """File -> pinned host staging buffer -> device, in chunks."""
        import torch

        if self._base is None:
            raise SegmentError("the CUDA segment was destroyed")
        if self._staging is None:  # one pinned buffer, reused for every read into this segment
            self._staging = torch.empty(min(self.manifest.size, STAGING_BYTES), dtype=torch.uint8).pin_memory()
        staging = self._staging
        with memoryview(staging.numpy()) as host:
            done = 0
            while done < nbytes:
                chunk = min(nbytes - done, len(host))
                n = os.preadv(fd, [host[:chunk]], file_offset + done)
                if n == 0:
                    raise SegmentError(f"file ended {nbytes - done} bytes early while filling a CUDA segment")
                # a blocking copy: the staging buffer is free again when it returns
                self._base[segment_offset + done:segment_offset + done + n].copy_(staging[:n])
                done += n

    def seal(self) -> None:
        import torch

        torch.cuda.synchronize(self.index)
        self._staging = None

    def destroy(self) -> None:
        if self._ptr is None:
            return
        self._base = self._staging = None
        with self._cupy.cuda.Device(self.index):
            self._cupy.cuda.runtime.free(self._ptr)
        self._ptr = None


class CudaAttachment:
    """An attacher's mapping of a CUDA segment through its IPC handle."""

    def __init__(self, manifest: SegmentManifest) -> None:
        check_manifest(manifest)
        if not isinstance(manifest.location, CudaIpcLocation):
            raise SegmentError(f"manifest is for transport {manifest.transport}, not cuda_ipc")
        cupy = require_cupy()
        self._cupy = cupy
        self.index = manifest.location.device_index
        if manifest.location.owner_pid == os.getpid():
            raise SegmentError("a CUDA IPC handle cannot be opened by the process that exported it")
        with cupy.cuda.Device(self.index):
            try:
                self._ptr: int | None = cupy.cuda.runtime.ipcOpenMemHandle(
                    manifest.location.handle, cupy.cuda.runtime.cudaIpcMemLazyEnablePeerAccess
                )
            except cupy.cuda.runtime.CUDARuntimeError as exc:
                raise SegmentError(f"cannot open the CUDA IPC handle of cuda:{self.index}: {exc}") from exc
        base = _as_torch(cupy, self._ptr, manifest.size, self.index, self)
        self.manifest = manifest
        self.device = manifest.device
        self.base_ptr = base.data_ptr()
        self.size = manifest.size
        self.tensors = tensor_views(base, manifest.tensors)

    def contains(self, tensor) -> bool:
        return segment_contains(self.base_ptr, self.size, tensor)

    def close(self) -> None:
        """Drop the views and close the handle; tensors still viewing the segment must not be used afterwards."""
        self.tensors = {}
        if self._ptr is None:
            return
        import torch

        torch.cuda.synchronize(self.index)
        with self._cupy.cuda.Device(self.index):
            self._cupy.cuda.runtime.ipcCloseMemHandle(self._ptr)
        self._ptr = None
