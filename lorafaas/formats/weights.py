"""Reading safetensors files without loading them: the header, its checks, and pickled-weight detection.

The model store, the adapter tooling and the backbone daemon (which reads tensors straight into a shared segment)
all go through here, so a truncated or hostile file is refused the same way everywhere.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from lorafaas.errors import MalformedModel

# Suffixes of formats that unpickle on load, i.e. can run arbitrary code.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")

DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E5M2": 1,
}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offset of the first byte, relative to the start of the data section
    end: int

    @property
    def num_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def num_bytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    data_offset: int  # absolute offset of the data section in the file
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]

    @property
    def num_parameters(self) -> int:
        return sum(t.num_elements for t in self.tensors.values())

    @property
    def num_bytes(self) -> int:
        return sum(t.num_bytes for t in self.tensors.values())


def read_safetensors_header(path: Path) -> SafetensorsHeader:
    """Parse and check a safetensors header; raises MalformedModel naming the file and what is wrong."""
    path = Path(path)
    file_size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise MalformedModel(f"{path}: {file_size} bytes is too short for a safetensors file")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
            raise MalformedModel(
                f"{path}: header claims {header_len} bytes but the file has {file_size}; the file is truncated "
                "or not safetensors"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MalformedModel(f"{path}: the safetensors header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise MalformedModel(f"{path}: the safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_offset = 8 + header_len
    data_size = file_size - data_offset
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        tensors[name] = _tensor_info(path, name, entry, data_size)
    _check_layout(path, tensors, data_size)
    return SafetensorsHeader(path=path, data_offset=data_offset, tensors=tensors, metadata=dict(metadata))


def _tensor_info(path: Path, name: str, entry: object, data_size: int) -> TensorInfo:
    try:
        dtype = entry["dtype"]  # type: ignore[index]
        shape = tuple(int(d) for d in entry["shape"])  # type: ignore[index]
        begin, end = (int(o) for o in entry["data_offsets"])  # type: ignore[index]
    except (TypeError, KeyError, ValueError) as exc:
        raise MalformedModel(f"{path}: tensor {name!r} has a malformed header entry") from exc
    if dtype not in DTYPE_SIZES:
        raise MalformedModel(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
    if any(d < 0 for d in shape) or not 0 <= begin <= end:
        raise MalformedModel(f"{path}: tensor {name!r} has invalid shape {shape} or offsets [{begin}, {end})")
    if end - begin != math.prod(shape) * DTYPE_SIZES[dtype]:
        raise MalformedModel(
            f"{path}: tensor {name!r} of shape {shape} and dtype {dtype} needs "
            f"{math.prod(shape) * DTYPE_SIZES[dtype]} bytes but its offsets span {end - begin}"
        )
    if end > data_size:
        raise MalformedModel(
            f"{path}: tensor {name!r} ends at byte {end} of the data section, which has only {data_size} bytes; "
            "the file is truncated"
        )
    return TensorInfo(name=name, dtype=dtype, shape=shape, begin=begin, end=end)


def _check_layout(path: Path, tensors: dict[str, TensorInfo], data_size: int) -> None:
    """The tensors tile the data section exactly, as the safetensors library requires: no overlap, gap or tail."""
    offset = 0
    for info in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if info.begin < offset:
            raise MalformedModel(f"{path.name}: tensor {info.name!r} at bytes [{info.begin}, {info.end}) overlaps the "
                                 f"tensor before it, which ends at {offset}")
        if info.begin > offset:
            raise MalformedModel(f"{path.name}: bytes [{offset}, {info.begin}) of the data section belong to no tensor")
        offset = info.end
    if offset != data_size:
        raise MalformedModel(f"{path.name}: {data_size - offset} trailing bytes after the last tensor (the data "
                             f"section has {data_size} bytes, the tensors cover {offset})")


def pickled_files(directory: Path) -> list[Path]:
    return sorted(p for p in Path(directory).iterdir() if p.is_file() and p.suffix.lower() in PICKLE_SUFFIXES)
