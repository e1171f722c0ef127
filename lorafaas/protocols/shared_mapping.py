"""A shared read-write mapping of a file that holds no descriptor of it. Python's `mmap.mmap` keeps a duplicate of
the descriptor for its whole life (3.13's `trackfd=False` aside), so a process that maps another's buffer with it
keeps that buffer reopenable through its `/proc/PID/fd`. `map_shared` maps with libc's mmap instead: the caller
closes its descriptor, and the mapping goes (munmap) when the last object viewing it does (a tensor made with
`torch.frombuffer` keeps it alive), never under a live view."""

from __future__ import annotations

import ctypes
import mmap
import weakref

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
MAP_FAILED = ctypes.c_void_p(-1).value


def map_shared(fd: int, size: int) -> ctypes.Array:
    """`size` bytes of the file `fd` mapped shared, readable and writable: a ctypes byte array over the mapping
    (a buffer for `torch.frombuffer`). Raises OSError as mmap(2) fails (PermissionError for a file sealed against
    writes)."""
    address = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if address in (None, MAP_FAILED):
        errno = ctypes.get_errno()
        raise OSError(errno, f"mmap of {size} bytes failed")
    mapping_type: type[ctypes.Array[ctypes.c_ubyte]] = type("SharedMapping", (ctypes.c_ubyte * size,), {})
    array = mapping_type.from_address(address)
    weakref.finalize(array, _libc.munmap, address, size)
    return array
