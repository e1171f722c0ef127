"""The few CUDA driver calls the GPU transport needs, over ctypes: the virtual memory management (VMM) API.

    create(index, size) -> (handle, allocation_size)     cuMemCreate, shareable as a POSIX file descriptor
    export_fd(handle) -> fd                               cuMemExportToShareableHandle
    import_fd(fd) -> handle                               cuMemImportFromShareableHandle
    map_range(index, handle, size, writable) -> ptr       cuMemAddressReserve + cuMemMap + cuMemSetAccess
    unmap_range(ptr, size), release(handle)

libcuda is the driver torch itself loads (libcuda.so.1, from the host's NVIDIA driver); nothing else is installed for
this (no cupy, no cuda-python: five calls and two structs). A descriptor exported this way is an ordinary file
descriptor: it crosses a Unix socket with SCM_RIGHTS like the CPU's memfd, needs neither hostIPC nor hostPID, and
an importer that maps it with read-only access faults on any write (the error is the writer's, in its own context).
Only `device_memory` and `device_uuid` are used outside the transport (default budgets, manifests).

Written against the CUDA 12 driver API documentation; `tests/integration/test_cuda_vmm.py` exercises it where a GPU
is present (it passed on an NVIDIA H200 with the CUDA 13 driver, scripts/gpu-check.sh) and skips elsewhere.
"""

from __future__ import annotations

import ctypes
import functools

from lorafaas.errors import SegmentError, TransportUnavailable

CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
CU_MEM_ACCESS_FLAGS_PROT_READ = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class CUmemAllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", CUmemLocation),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_int)]


class CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


@functools.cache
def driver() -> ctypes.CDLL:
    """libcuda, initialised; TransportUnavailable if there is no driver or no device."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise TransportUnavailable(f"the CUDA driver (libcuda.so.1) is not available here: {exc}") from exc
    _check(lib, lib.cuInit(0), "cuInit")
    count = ctypes.c_int()
    _check(lib, lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
    if count.value == 0:
        raise TransportUnavailable("the CUDA driver sees no device")
    return lib


def _check(lib: ctypes.CDLL, result: int, call: str) -> None:
    if result == 0:
        return
    message = ctypes.c_char_p()
    lib.cuGetErrorString(result, ctypes.byref(message))
    text = message.value.decode() if message.value else f"error {result}"
    raise SegmentError(f"{call} failed: {text} (CUresult {result})")


def _call(name: str, *args) -> None:
    lib = driver()
    _check(lib, getattr(lib, name)(*args), name)


def _device(index: int) -> ctypes.c_int:
    device = ctypes.c_int()
    _call("cuDeviceGet", ctypes.byref(device), index)
    return device


def use_primary_context(index: int) -> None:
    """Make device `index`'s primary context (the one torch uses) current on this thread."""
    context = ctypes.c_void_p()
    _call("cuDevicePrimaryCtxRetain", ctypes.byref(context), _device(index))
    _call("cuCtxSetCurrent", context)


def device_uuid(index: int) -> str:
    """'GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx', as nvidia-smi and the device plugin name the device."""
    uuid = CUuuid()
    _call("cuDeviceGetUuid_v2", ctypes.byref(uuid), _device(index))
    h = bytes(uuid.bytes).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def device_count() -> int:
    count = ctypes.c_int()
    _call("cuDeviceGetCount", ctypes.byref(count))
    return count.value


def device_memory(index: int) -> tuple[int, int]:
    """(free, total) bytes of device `index`."""
    use_primary_context(index)
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    _call("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
    return free.value, total.value


def _properties(index: int) -> CUmemAllocationProp:
    prop = CUmemAllocationProp()
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop.location = CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, index)
    return prop


def granularity(index: int) -> int:
    value = ctypes.c_size_t()
    prop = _properties(index)
    _call("cuMemGetAllocationGranularity", ctypes.byref(value), ctypes.byref(prop), CU_MEM_ALLOC_GRANULARITY_MINIMUM)
    return value.value


def create(index: int, size: int) -> tuple[int, int]:
    """A physical allocation of at least `size` bytes on device `index`, exportable as a POSIX descriptor; returns
    (handle, allocation size rounded up to the granularity)."""
    step = granularity(index)
    allocation_size = -(-size // step) * step
    handle = ctypes.c_ulonglong()
    prop = _properties(index)
    _call("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(allocation_size), ctypes.byref(prop),
          ctypes.c_ulonglong(0))
    return handle.value, allocation_size


def export_fd(handle: int) -> int:
    fd = ctypes.c_int()
    _call("cuMemExportToShareableHandle", ctypes.byref(fd), ctypes.c_ulonglong(handle),
          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, ctypes.c_ulonglong(0))
    return fd.value


def import_fd(fd: int) -> int:
    """The allocation behind a descriptor from `export_fd` (the caller keeps and closes `fd`)."""
    handle = ctypes.c_ulonglong()
    _call("cuMemImportFromShareableHandle", ctypes.byref(handle), ctypes.c_void_p(fd),
          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    return handle.value


def map_range(index: int, handle: int, allocation_size: int, *, writable: bool) -> int:
    """Reserve an address range, map the allocation there and grant device `index` read (or read-write) access."""
    ptr = ctypes.c_ulonglong()
    _call("cuMemAddressReserve", ctypes.byref(ptr), ctypes.c_size_t(allocation_size), ctypes.c_size_t(0),
          ctypes.c_ulonglong(0), ctypes.c_ulonglong(0))
    try:
        _call("cuMemMap", ptr, ctypes.c_size_t(allocation_size), ctypes.c_size_t(0), ctypes.c_ulonglong(handle),
              ctypes.c_ulonglong(0))
        try:
            set_access(index, ptr.value, allocation_size, writable=writable)
        except SegmentError:
            _call("cuMemUnmap", ptr, ctypes.c_size_t(allocation_size))
            raise
    except SegmentError:
        _call("cuMemAddressFree", ptr, ctypes.c_size_t(allocation_size))
        raise
    return ptr.value


def set_access(index: int, ptr: int, allocation_size: int, *, writable: bool) -> None:
    flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE if writable else CU_MEM_ACCESS_FLAGS_PROT_READ
    desc = CUmemAccessDesc(CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, index), flags)
    _call("cuMemSetAccess", ctypes.c_ulonglong(ptr), ctypes.c_size_t(allocation_size), ctypes.byref(desc),
          ctypes.c_size_t(1))


def unmap_range(ptr: int, allocation_size: int) -> None:
    _call("cuMemUnmap", ctypes.c_ulonglong(ptr), ctypes.c_size_t(allocation_size))
    _call("cuMemAddressFree", ctypes.c_ulonglong(ptr), ctypes.c_size_t(allocation_size))


def release(handle: int) -> None:
    """Drop this handle; the memory goes when no handle (imported ones included) and no mapping is left."""
    _call("cuMemRelease", ctypes.c_ulonglong(handle))
