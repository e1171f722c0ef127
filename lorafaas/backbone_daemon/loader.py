"""Loading a backbone from the model store into one segment, in the layout the model's modules expect.

The segment holds the model's state dict (module names and shapes, checkpoint dtypes), so binding is a plain
name-for-name assignment. The plan comes from the model itself (built on the meta device) and the safetensors
headers; each checkpoint tensor's bytes are then read from the file straight into their place in the segment.

Checkpoints whose layout differs from the modules' go through transformers' own conversion mapping (transformers 5):
renamings are applied as transformers applies them, and the conversions that only place bytes (stacking per-expert
matrices into one fused tensor, e.g. Mixtral's `w1`/`w3` -> `experts.gate_up_proj`) become placements inside the
target tensor. A conversion that computes (transpose, permute, split) is left to transformers: the model is loaded
privately once and its tensors copied into the segment.

The bytes are read by segment_fill.py: few large vectored reads straight into the segment, on a few threads. On a
CPU the linear weights can then be rewritten in oneDNN's blocked layout before the seal (`pack_linears`,
lorafaas/models/packed_weights.py); a backbone loaded through transformers keeps the plain layout.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from lorafaas import cuda_ipc
from lorafaas.backbone_daemon.segment_fill import Placement, SpanRead, default_threads, fill, plan_reads
from lorafaas.cuda_ipc.layout import SAFETENSORS_DTYPES, TensorSpec, dtype_name
from lorafaas.errors import MalformedModel
from lorafaas.formats.weights import read_safetensors_header
from lorafaas.models.binding import build_empty_model, tied_weight_keys
from lorafaas.models.packed_weights import linear_weight_names, mark_packed, pack_in_place

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Piece:
    """Bytes of one checkpoint tensor, placed inside one target tensor of the segment."""

    target: str
    target_offset: int  # bytes from the start of the target tensor
    file: Path
    file_offset: int  # absolute offset in the file
    nbytes: int


@dataclass(frozen=True)
class LoadPlan:
    specs: tuple[TensorSpec, ...]
    pieces: tuple[Piece, ...]
    linear_weights: frozenset[str] = frozenset()  # read by a plain linear layer only: may be packed for oneDNN


class NotPlaceable(Exception):
    """The checkpoint needs a conversion that computes; internal to this module."""


@dataclass(frozen=True)
class _Grouped:
    pattern_index: int
    expert: int
    dtype: str
    shape: tuple[int, ...]
    file: Path
    file_offset: int
    nbytes: int


def load_into_segment(model_dir: Path, weight_files: tuple[str, ...], device: str, name: str,
                      pack_linears: bool = False) -> cuda_ipc.Export:
    """A sealed segment holding the backbone at `model_dir`; reads straight from the files where it can. With
    `pack_linears`, a CPU segment holds its linear weights in oneDNN's blocked layout (module docstring)."""
    started = time.perf_counter()
    paths = [Path(model_dir) / f for f in weight_files]
    try:
        plan = plan_direct_load(model_dir, paths)
    except NotPlaceable as exc:
        log.info("backbone at %s needs a computed weight conversion (%s); loading it through transformers",
                 model_dir, exc)
        segment = _load_through_transformers(model_dir, device, name)
        log.info("loaded %d tensors through transformers into segment on %s in %.0f ms",
                 len(segment.manifest.tensors), device, (time.perf_counter() - started) * 1e3)
        return segment
    planned = time.perf_counter()
    segment = execute_plan(plan, device, name, pack_linears)
    read_s = time.perf_counter() - planned
    size = segment.manifest.size
    log.info("planned %d tensors in %.0f ms; read %d bytes from the store into the segment on %s in %.0f ms "
             "(%.0f MB/s)", len(plan.specs), (planned - started) * 1e3, size, device, read_s * 1e3,
             size / 1e6 / max(read_s, 1e-9))
    return segment


def plan_direct_load(model_dir: Path, weight_files: list[Path]) -> LoadPlan:
    model = build_empty_model(model_dir)
    meta = model.state_dict()
    renamings, converters = _conversions(model)
    direct: dict[str, Piece] = {}
    dtypes: dict[str, str] = {}
    grouped: dict[str, list[_Grouped]] = defaultdict(list)
    group_converter: dict[str, object] = {}
    for path in weight_files:
        header = read_safetensors_header(path)
        for key, info in header.tensors.items():
            target, pattern = _rename(key, renamings, converters, model.base_model_prefix, meta)
            if target not in meta:
                log.debug("checkpoint tensor %s (-> %s) is not in the model; skipped", key, target)
                continue
            dtype = SAFETENSORS_DTYPES[info.dtype]
            file_offset = header.data_offset + info.begin
            if pattern is None:
                if tuple(meta[target].shape) != info.shape:
                    raise MalformedModel(f"{path}: tensor {key} is {info.shape}; the model's {target} is "
                                         f"{tuple(meta[target].shape)}")
                if target in direct or target in grouped:
                    raise MalformedModel(f"{path}: two checkpoint tensors load into {target}")
                direct[target] = Piece(target, 0, path, file_offset, info.num_bytes)
                dtypes[target] = dtype
                continue
            converter = next(c for c in converters if pattern in c.source_patterns)
            group_converter[target] = converter
            grouped[target].append(_Grouped(converter.source_patterns.index(pattern), _expert_index(pattern, key),
                                            dtype, info.shape, path, file_offset, info.num_bytes))
    pieces = list(direct.values())
    for target, members in grouped.items():
        pieces.extend(_place_group(target, tuple(meta[target].shape), group_converter[target], members))
        dtypes[target] = members[0].dtype
    tied = tied_weight_keys(model)
    expected = [n for n in meta if not _tied_and_absent(n, tied, dtypes)]
    missing = [n for n in expected if n not in dtypes]
    if missing:
        raise MalformedModel(f"{model_dir}: the checkpoint has no weights for {len(missing)} tensor(s) of the model, "
                             f"e.g. {missing[:3]}")
    specs = tuple(TensorSpec(n, dtypes[n], tuple(meta[n].shape)) for n in expected)
    tied_names = set(tied) | set(tied.values())
    return LoadPlan(specs=specs, pieces=tuple(pieces),
                    linear_weights=frozenset(linear_weight_names(model, tied_names) & set(expected)))


def plan_file_load(weight_files: list[Path]) -> LoadPlan:
    """Every tensor of the files, as stored (no model): what `lorafaas bench load` loads from a synthetic file."""
    specs: list[TensorSpec] = []
    pieces: list[Piece] = []
    for path in weight_files:
        header = read_safetensors_header(path)
        for key, info in header.tensors.items():
            specs.append(TensorSpec(key, SAFETENSORS_DTYPES[info.dtype], info.shape))
            pieces.append(Piece(key, 0, path, header.data_offset + info.begin, info.num_bytes))
    return LoadPlan(specs=tuple(specs), pieces=tuple(pieces))


def _tied_and_absent(name: str, tied: dict[str, str], present: dict[str, str]) -> bool:
    """A tied parameter the checkpoint lacks while its partner is present: binding ties it, the segment skips it."""
    if name in present:
        return False
    partners = [s for t, s in tied.items() if t == name] + [t for t, s in tied.items() if s == name]
    return any(p in present for p in partners)


def _conversions(model) -> tuple[list, list]:
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except ImportError:  # transformers 4: checkpoint names are module names
        return [], []
    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return [t for t in transforms if not isinstance(t, WeightConverter)], converters


def _rename(key: str, renamings: list, converters: list, prefix: str, meta: dict) -> tuple[str, str | None]:
    if not renamings and not converters:
        return key, None
    from transformers.core_model_loading import rename_source_key

    return rename_source_key(key, renamings, converters, prefix, meta)


def _expert_index(pattern: str, key: str) -> int:
    regex = re.escape(pattern).replace(r"\*", r"(\d+)")
    match = re.search(regex, key)
    if match is None or match.lastindex != 1:
        raise NotPlaceable(f"cannot find the expert index of {key} in pattern {pattern}")
    return int(match.group(1))


def _place_group(target: str, target_shape: tuple[int, ...], converter, members: list[_Grouped]) -> list[Piece]:
    """Placements for per-expert tensors stacked (MergeModulelist(0)) and, with several sources, fused along dim 1."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(getattr(converter, "operations", []))
    num_sources = len(converter.source_patterns)
    stacked = len(ops) >= 1 and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
    fused = len(ops) == 2 and isinstance(ops[1], Concatenate) and ops[1].dim == 1
    if not stacked or len(ops) > 2 or (len(ops) == 2 and not fused) or (num_sources > 1 and not fused):
        raise NotPlaceable(f"{target} is built by {ops}")
    shapes = {m.pattern_index: m.shape for m in members}
    if len(shapes) != num_sources or any(m.shape != shapes[m.pattern_index] for m in members):
        raise NotPlaceable(f"the sources of {target} have uneven shapes")
    rows = sum(shapes[i][0] for i in range(num_sources))
    rest = shapes[0][1:]
    num_experts = target_shape[0]
    expected_shape = (num_experts, *shapes[0]) if num_sources == 1 else (num_experts, rows, *rest)
    if target_shape != expected_shape or any(shapes[i][1:] != rest for i in range(num_sources)):
        raise NotPlaceable(f"{target} is {target_shape}, its sources stack to {expected_shape}")
    slots = {(m.pattern_index, m.expert) for m in members}
    if len(slots) != len(members) or len(members) != num_experts * num_sources or \
            any(not 0 <= m.expert < num_experts for m in members):
        raise MalformedModel(f"the checkpoint's experts for {target} are incomplete or repeated")
    if len({m.dtype for m in members}) != 1:
        raise MalformedModel(f"the checkpoint's tensors for {target} mix dtypes")
    chunk = {m.pattern_index: m.nbytes for m in members}
    stride = sum(chunk.values())
    before = {i: sum(chunk[j] for j in range(i)) for i in range(num_sources)}
    return [Piece(target, m.expert * stride + before[m.pattern_index], m.file, m.file_offset, m.nbytes)
            for m in members]


def execute_plan(plan: LoadPlan, device: str, name: str, pack_linears: bool = False) -> cuda_ipc.Export:
    """A new sealed segment on `device` filled by the plan's reads (its linear weights packed for oneDNN with
    `pack_linears`, on a CPU)."""
    segment = cuda_ipc.create(plan.specs, device, name=name)
    fds: dict[Path, int] = {}
    try:
        reads = load_reads(plan, segment.manifest)
        for path in {p.file for p in plan.pieces}:
            fds[path] = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fds[path], 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger readahead window from a disk
        fill(segment, reads, fds, default_threads(device))
        if pack_linears:
            started = time.perf_counter()
            packed = pack_in_place(segment, plan.linear_weights)
            log.info("packed %d of %d linear weights for oneDNN in %.0f ms", packed, len(plan.linear_weights),
                     (time.perf_counter() - started) * 1e3)
        segment.seal()
    except BaseException:
        segment.destroy()
        raise
    finally:
        for fd in fds.values():
            os.close(fd)
    return segment


def load_reads(plan: LoadPlan, target: cuda_ipc.SegmentManifest) -> list[SpanRead]:
    """The reads that fill segment `target` by `plan` (sources: the files' paths)."""
    offsets = {e.name: e.offset for e in target.tensors}
    return plan_reads(Placement(p.file, p.file_offset, offsets[p.target] + p.target_offset, p.nbytes)
                      for p in plan.pieces)


def copy_reads(source: cuda_ipc.SegmentManifest, target: cuda_ipc.SegmentManifest) -> list[SpanRead]:
    """The reads that fill segment `target` with the tensors of CPU segment `source` (source 0: its descriptor)."""
    offsets = {e.name: e.offset for e in target.tensors}
    return plan_reads(Placement(0, e.offset, offsets[e.name], e.nbytes) for e in source.tensors)


def copy_segment(manifest: cuda_ipc.SegmentManifest, fd: int, device: str, name: str,
                 num_threads: int | None = None) -> cuda_ipc.Export:
    """A new sealed segment on `device` holding the tensors of the sealed CPU segment `fd` (described by `manifest`,
    e.g. one the host tier kept): the same placed reads as a load from the store, from memory instead of a file.
    Weights packed for oneDNN stay packed, on a CPU only."""
    if not isinstance(manifest.location, cuda_ipc.MemfdLocation):
        raise MalformedModel(f"a {manifest.transport} segment cannot be read as a file; only a CPU segment can")
    packed = {e.name: e.onednn_md for e in manifest.tensors if e.onednn_md is not None}
    if packed and device != "cpu":
        raise MalformedModel(f"the segment's weights are packed for oneDNN on a CPU; they cannot be copied to {device}")
    specs = [cuda_ipc.TensorSpec(e.name, e.dtype, e.shape) for e in manifest.tensors]
    segment = cuda_ipc.create(specs, device, name=name)
    try:
        reads = copy_reads(manifest, segment.manifest)
        fill(segment, reads, {0: fd}, default_threads(device) if num_threads is None else num_threads)
        mark_packed(segment, packed)
        segment.seal()
    except BaseException:
        segment.destroy()
        raise
    return segment


def _load_through_transformers(model_dir: Path, device: str, name: str) -> cuda_ipc.Export:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    state: dict = {}
    seen: set[int] = set()
    for tensor_name, tensor in model.state_dict().items():  # tied tensors appear under both names: keep the first
        if tensor.data_ptr() in seen and tensor.numel():
            continue
        seen.add(tensor.data_ptr())
        dtype_name(tensor.dtype)  # refuse unshareable dtypes with a clear error
        state[tensor_name] = tensor
    return cuda_ipc.export(state, device, name=name)
