"""The GPU transport: one CUDA VMM allocation per segment, exported as a POSIX file descriptor, mapped read-only.

The owner (the backbone daemon) creates the allocation (`cuMemCreate`, shareable as a POSIX descriptor), maps it
read-write only while filling it (from the files, through one pinned staging buffer), then unmaps it (`seal`): from
then on it holds the allocation's handle and exported descriptor, and no mapping. The descriptor travels over the
daemon's Unix socket like the CPU's memfd. An attacher imports it (`cuMemImportFromShareableHandle`), maps it and
grants its device read-only access (`cuMemSetAccess`): a kernel that writes there faults in the writer's context and
nowhere else. The manifest names the GPU by UUID (indexes differ between containers: CUDA_VISIBLE_DEVICES, the
device plugin); an attacher that sees no device with that UUID refuses the segment.

Tensors over device memory are made with `__cuda_array_interface__` (torch keeps the owner alive while any view
lives). The legacy CUDA IPC transport (cudaIpcGetMemHandle) is gone: its handles cannot be opened across PID
namespaces, it needs hostIPC, it has no read-only mapping, and its allocations die with the exporter.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lorafaas.cuda_ipc import cuda_driver
from lorafaas.cuda_ipc.layout import check_manifest, segment_contains, tensor_views
from lorafaas.cuda_ipc.messages import CudaVmmLocation, SegmentManifest, TensorEntry
from lorafaas.errors import InsufficientMemory, SegmentError, TransportUnavailable

if TYPE_CHECKING:  # imported where used: a CPU-only process never loads torch's CUDA parts for this module
    import torch

STAGING_BYTES = 64 * 1024 * 1024  # the pinned host buffer for file -> device copies


def device_index(device: str) -> int:
    prefix, _, index = device.partition(":")
    if prefix != "cuda" or not index.isdigit():
        raise TransportUnavailable(f"device {device!r} is not a CUDA device; expected cuda:N")
    return int(index)


def require_cuda(device: str) -> None:
    """TransportUnavailable unless torch and the driver see `device` (cuda:N)."""
    import torch

    index = device_index(device)
    if not torch.cuda.is_available():
        raise TransportUnavailable(f"{device} needs CUDA, and torch sees no GPU here")
    if index >= cuda_driver.device_count():
        raise TransportUnavailable(f"{device} does not exist: the driver sees {cuda_driver.device_count()} GPU(s)")


def local_index(device_uuid: str) -> int:
    """This process's index of the GPU with `device_uuid`; SegmentError if it sees no such GPU."""
    seen = [cuda_driver.device_uuid(i) for i in range(cuda_driver.device_count())]
    if device_uuid not in seen:
        raise SegmentError(f"the segment lives on {device_uuid}; this process sees {', '.join(seen) or 'no GPU'}")
    return seen.index(device_uuid)


class _DeviceBytes:
    """Device memory as `__cuda_array_interface__`, for torch.as_tensor (which keeps this object, and `owner`,
    alive as long as a tensor views it)."""

    def __init__(self, ptr: int, size: int, owner: object) -> None:
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 3,
                                         "strides": None}
        self.owner = owner


def _as_tensor(ptr: int, size: int, index: int, owner: object) -> torch.Tensor:
    import torch

    return torch.as_tensor(_DeviceBytes(ptr, size, owner), device=f"cuda:{index}")


class CudaExport:
    """The owner's side: one exported VMM allocation, filled through a temporary read-write mapping."""

    def __init__(self, device: str, entries: tuple[TensorEntry, ...], size: int, alignment: int) -> None:
        import torch

        require_cuda(device)
        self.index = device_index(device)
        torch.cuda.init()
        cuda_driver.use_primary_context(self.index)
        free, _total = cuda_driver.device_memory(self.index)
        if size > free:
            raise InsufficientMemory(f"the backbone segment needs {size} bytes on {device}; {free} bytes are free")
        self._handle: int | None = None
        self._ptr: int | None = None
        self.fd: int | None = None
        self._handle, self.allocation_size = cuda_driver.create(self.index, size)
        try:
            self.fd = cuda_driver.export_fd(self._handle)
            self._ptr = cuda_driver.map_range(self.index, self._handle, self.allocation_size, writable=True)
        except BaseException:
            self.destroy()
            raise
        self.manifest = SegmentManifest(
            device=device,
            location=CudaVmmLocation(device_uuid=cuda_driver.device_uuid(self.index),
                                     allocation_size=self.allocation_size),
            size=size,
            alignment=alignment,
            tensors=entries,
        )
        self._base: torch.Tensor | None = _as_tensor(self._ptr, size, self.index, self)
        self._staging: torch.Tensor | None = None
        self._staging_lock = threading.Lock()

    def writable_views(self) -> dict:
        if self._base is None:
            raise SegmentError("the CUDA segment is sealed; it cannot be written any more")
        return tensor_views(self._base, self.manifest.tensors)

    def read_spans(self, fd: int, file_offset: int, spans: Sequence[tuple[int, int]]) -> None:
        """File -> pinned host staging buffer -> device, in chunks: the file's bytes from `file_offset` on fill the
        segment's `spans` ((segment offset, nbytes)) in turn. One staging buffer: calls are serialised."""
        import torch

        if self._base is None:
            raise SegmentError("the CUDA segment is sealed; it cannot be written any more")
        for segment_offset, nbytes in spans:
            if segment_offset < 0 or nbytes < 0 or segment_offset + nbytes > self.manifest.size:
                raise SegmentError(f"write of {nbytes} bytes at {segment_offset} is outside the "
                                   f"{self.manifest.size}-byte CUDA segment")
        with self._staging_lock:
            if self._staging is None:  # allocated pinned (not pageable, then pinned): one buffer for every read
                self._staging = torch.empty(min(self.manifest.size, STAGING_BYTES), dtype=torch.uint8,
                                            pin_memory=True)
            staging = self._staging
            with staging.numpy().data as host:
                for segment_offset, nbytes in spans:
                    done = 0
                    while done < nbytes:
                        chunk = min(nbytes - done, len(host))
                        n = os.preadv(fd, [host[:chunk]], file_offset)
                        if n == 0:
                            raise SegmentError(f"file ended {nbytes - done} bytes early while filling a CUDA segment")
                        # a blocking copy: the staging buffer is free again when it returns
                        self._base[segment_offset + done:segment_offset + done + n].copy_(staging[:n])
                        done += n
                        file_offset += n

    def seal(self) -> None:
        """Wait for the copies, then drop the owner's mapping: it keeps the handle and the descriptor only."""
        import torch

        torch.cuda.synchronize(self.index)
        self._staging = None
        self._unmap()

    def _unmap(self) -> None:
        if self._ptr is not None:
            self._base = None
            cuda_driver.unmap_range(self._ptr, self.allocation_size)
            self._ptr = None

    def destroy(self) -> None:
        self._staging = None
        self._unmap()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self._handle is not None:
            cuda_driver.release(self._handle)
            self._handle = None


class CudaAttachment:
    """An attacher's read-only mapping of an exported CUDA segment."""

    def __init__(self, manifest: SegmentManifest, fd: int) -> None:
        import torch

        check_manifest(manifest)
        location = manifest.location
        if not isinstance(location, CudaVmmLocation):
            raise SegmentError(f"manifest is for transport {manifest.transport}, not cuda_vmm")
        if location.allocation_size < manifest.size:
            raise SegmentError(f"the CUDA allocation has {location.allocation_size} bytes; the manifest says "
                               f"{manifest.size}")
        require_cuda("cuda:0")
        self.index = local_index(location.device_uuid)
        torch.cuda.init()
        cuda_driver.use_primary_context(self.index)
        self.allocation_size = location.allocation_size
        self._handle: int | None = cuda_driver.import_fd(fd)
        try:
            self._ptr: int | None = cuda_driver.map_range(self.index, self._handle, self.allocation_size,
                                                          writable=False)
        except BaseException:
            cuda_driver.release(self._handle)
            raise
        base = _as_tensor(self._ptr, manifest.size, self.index, self)
        self.manifest = manifest
        self.device = f"cuda:{self.index}"
        self.base_ptr = base.data_ptr()
        self.size = manifest.size
        self.tensors = tensor_views(base, manifest.tensors)

    def contains(self, tensor) -> bool:
        return segment_contains(self.base_ptr, self.size, tensor)

    def close(self) -> None:
        """Drop the views, unmap and release; tensors still viewing the segment must not be used afterwards."""
        self.tensors = {}
        if self._ptr is None:
            return
        import torch

        torch.cuda.synchronize(self.index)
        cuda_driver.unmap_range(self._ptr, self.allocation_size)
        if self._handle is not None:  # (set with the mapping)
            cuda_driver.release(self._handle)
        self._ptr = self._handle = None
