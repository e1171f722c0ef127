"""The manifest of an exported segment: where the segment is and which tensor lies where in it.

It crosses the process boundary inside the backbone daemon's protocol, with the segment's file descriptor beside it
(SCM_RIGHTS); tensors never do. A manifest is checked on receipt (`lorafaas.cuda_ipc.layout.check_manifest`) before
anything is mapped.
"""

from __future__ import annotations

import msgspec

FORMAT_VERSION = 3  # 2: memfd and CUDA VMM locations, passed as descriptors; 3: weights packed for oneDNN


class TensorEntry(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    dtype: str  # a torch dtype name without the "torch." prefix: "float32", "bfloat16", ...
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the segment; a multiple of the manifest's alignment
    nbytes: int
    # A linear weight stored in oneDNN's blocked layout (lorafaas/models/packed_weights.py): its serialized memory
    # descriptor. The entry's plain view then holds the packed bytes, not the weight's values in order.
    onednn_md: bytes | None = None


class MemfdLocation(msgspec.Struct, frozen=True, kw_only=True, tag="memfd", tag_field="transport"):
    """A sealed memfd on the CPU. It has no name anywhere in a filesystem: its descriptor travels beside the manifest
    (SCM_RIGHTS over the daemon's socket) and an attacher checks that the descriptor it got is this file, sealed."""

    label: str  # the memfd's name, for people: /proc/PID/maps shows "/memfd:LABEL (deleted)"
    inode: int  # the descriptor received must be this inode


class CudaVmmLocation(msgspec.Struct, frozen=True, kw_only=True, tag="cuda_vmm", tag_field="transport"):
    """One allocation of the CUDA virtual memory API, exported as a POSIX file descriptor (passed beside the manifest,
    like a memfd). The GPU is named by its UUID: an index means nothing across containers (CUDA_VISIBLE_DEVICES)."""

    device_uuid: str  # "GPU-8f3c...": an attacher refuses the segment unless its own device has this UUID
    allocation_size: int  # the exported allocation: `size` rounded up to the allocation granularity


SegmentLocation = MemfdLocation | CudaVmmLocation


class SegmentManifest(msgspec.Struct, frozen=True, kw_only=True):
    format_version: int = FORMAT_VERSION
    device: str  # "cpu" or "cuda:N"
    location: SegmentLocation
    size: int  # bytes of the segment, padding included
    alignment: int
    tensors: tuple[TensorEntry, ...]

    @property
    def transport(self) -> str:
        return "memfd" if isinstance(self.location, MemfdLocation) else "cuda_vmm"

    @property
    def tensor_bytes(self) -> int:
        """Bytes of tensor data, padding excluded."""
        return sum(t.nbytes for t in self.tensors)
