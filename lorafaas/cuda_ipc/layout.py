"""Laying tensors out in one segment, checking a received manifest, and viewing a segment as tensors.

Every tensor starts at a multiple of `alignment` bytes (256: a CUDA allocation's own alignment and a multiple of any
dtype's size and of a cache line), so a tensor is a plain `view` of the segment's bytes with no copy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lorafaas.cuda_ipc.messages import FORMAT_VERSION, SegmentManifest, TensorEntry
from lorafaas.errors import SegmentError

if TYPE_CHECKING:
    import torch

DEFAULT_ALIGNMENT = 256
MAX_ONEDNN_MD_BYTES = 4096  # a serialized oneDNN memory descriptor (about 800 bytes for a 2-D weight)
PACKABLE_DTYPES = ("float32", "bfloat16")

# Element sizes by torch dtype name; the dtypes a segment may hold.
DTYPE_SIZES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}
# safetensors dtype names -> torch dtype names
SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # torch dtype name
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise SegmentError(f"dtype {name} cannot be shared; supported: {', '.join(DTYPE_SIZES)}")
    return name


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def plan_layout(
    specs: Iterable[TensorSpec], alignment: int = DEFAULT_ALIGNMENT
) -> tuple[tuple[TensorEntry, ...], int]:
    """Entries in the given order at aligned offsets, and the segment size (at least one alignment unit)."""
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    entries: list[TensorEntry] = []
    seen: set[str] = set()
    offset = 0
    for spec in specs:
        if spec.name in seen:
            raise SegmentError(f"tensor {spec.name!r} appears twice in one segment")
        if spec.dtype not in DTYPE_SIZES:
            raise SegmentError(f"tensor {spec.name!r} has dtype {spec.dtype}, which cannot be shared")
        seen.add(spec.name)
        offset = align_up(offset, alignment)
        entries.append(TensorEntry(name=spec.name, dtype=spec.dtype, shape=spec.shape, offset=offset,
                                   nbytes=spec.nbytes))
        offset += spec.nbytes
    return tuple(entries), max(align_up(offset, alignment), alignment)


def check_manifest(manifest: SegmentManifest) -> None:
    """Refuse a manifest whose table would put a view outside the segment or on top of another tensor."""
    if manifest.format_version != FORMAT_VERSION:
        raise SegmentError(
            f"segment manifest has format version {manifest.format_version}; this lorafaas reads {FORMAT_VERSION}"
        )
    alignment = manifest.alignment
    if alignment <= 0 or alignment & (alignment - 1) or manifest.size <= 0:
        raise SegmentError(f"segment manifest has alignment {alignment} and size {manifest.size}")
    end_of_previous = 0
    for entry in sorted(manifest.tensors, key=lambda e: e.offset):
        size = DTYPE_SIZES.get(entry.dtype)
        if size is None:
            raise SegmentError(f"tensor {entry.name!r} has unknown dtype {entry.dtype!r}")
        if any(d < 0 for d in entry.shape) or entry.nbytes != math.prod(entry.shape) * size:
            raise SegmentError(
                f"tensor {entry.name!r} of shape {entry.shape} and dtype {entry.dtype} needs "
                f"{math.prod(entry.shape) * size} bytes but its entry says {entry.nbytes}"
            )
        if entry.offset % alignment or entry.offset < end_of_previous:
            raise SegmentError(
                f"tensor {entry.name!r} at offset {entry.offset} is unaligned ({alignment}) or overlaps the tensor "
                f"ending at {end_of_previous}"
            )
        if entry.offset + entry.nbytes > manifest.size:
            raise SegmentError(
                f"tensor {entry.name!r} ends at byte {entry.offset + entry.nbytes} of a {manifest.size}-byte segment"
            )
        if entry.onednn_md is not None and (len(entry.shape) != 2 or entry.dtype not in PACKABLE_DTYPES
                                            or not 0 < len(entry.onednn_md) <= MAX_ONEDNN_MD_BYTES):
            raise SegmentError(f"tensor {entry.name!r} is marked packed for oneDNN but is a {entry.dtype} "
                               f"{entry.shape} tensor with a {len(entry.onednn_md)}-byte descriptor")
        end_of_previous = entry.offset + entry.nbytes
    if len({e.name for e in manifest.tensors}) != len(manifest.tensors):
        raise SegmentError("segment manifest names a tensor twice")


def segment_contains(base_ptr: int, size: int, tensor: torch.Tensor) -> bool:
    """True if all of `tensor`'s bytes lie inside the segment [base_ptr, base_ptr + size)."""
    if tensor.numel() == 0:
        return True  # no bytes, nowhere to be
    start = tensor.data_ptr()
    return base_ptr <= start and start + tensor.numel() * tensor.element_size() <= base_ptr + size


def tensor_views(base: torch.Tensor, entries: Iterable[TensorEntry]) -> dict[str, torch.Tensor]:
    """Views of a flat uint8 tensor (the whole segment) as the tensors of the table; no byte is copied."""
    import torch

    views = {}
    for entry in entries:
        raw = base[entry.offset:entry.offset + entry.nbytes]
        views[entry.name] = raw.view(getattr(torch, entry.dtype)).view(entry.shape)
    return views
