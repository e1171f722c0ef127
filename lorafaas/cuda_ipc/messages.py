"""The manifest of an exported segment: where the segment is and which tensor lies where in it.

It is the only thing that crosses the process boundary (inside the backbone daemon's protocol, or as JSON in tests);
tensors never do. A manifest is checked on receipt (`lorafaas.cuda_ipc.layout.check_manifest`) before anything is
mapped.
"""

from __future__ import annotations

import msgspec

FORMAT_VERSION = 1


class TensorEntry(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    dtype: str  # a torch dtype name without the "torch." prefix: "float32", "bfloat16", ...
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the segment; a multiple of the manifest's alignment
    nbytes: int


class ShmLocation(msgspec.Struct, frozen=True, kw_only=True, tag="shm", tag_field="transport"):
    """A POSIX shared-memory segment: the file /dev/shm/NAME, mapped read-only by attachers."""

    name: str


class CudaIpcLocation(msgspec.Struct, frozen=True, kw_only=True, tag="cuda_ipc", tag_field="transport"):
    """One device allocation shared with cudaIpcGetMemHandle: one handle for the whole segment."""

    handle: bytes
    device_index: int
    owner_pid: int


SegmentLocation = ShmLocation | CudaIpcLocation


class SegmentManifest(msgspec.Struct, frozen=True, kw_only=True):
    format_version: int = FORMAT_VERSION
    device: str  # "cpu" or "cuda:N"
    location: SegmentLocation
    size: int  # bytes of the segment, padding included
    alignment: int
    tensors: tuple[TensorEntry, ...]

    @property
    def transport(self) -> str:
        return "shm" if isinstance(self.location, ShmLocation) else "cuda_ipc"

    @property
    def tensor_bytes(self) -> int:
        """Bytes of tensor data, padding excluded."""
        return sum(t.nbytes for t in self.tensors)
