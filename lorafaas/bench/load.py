"""`lorafaas bench load`: the backbone loader's GB/s from a cold file, from the page cache and from the host tier, each
beside the limit measured in the same run on the same bytes, and beside `safetensors.torch.load_file`.

    cold        the files dropped from the page cache first (posix_fadvise DONTNEED; whether that worked is checked
                with mincore and reported); limit: one sequential pass of 16 MiB reads into a preallocated,
                pre-faulted buffer of the data's size (what `dd bs=16M` does, without dd's buffer reuse)
    page_cache  the same, every page already cached
    host_tier   a new segment filled from a sealed segment kept in memory (what the host tier hands a daemon);
                limit: one memcpy of the same bytes into a pre-faulted buffer

The loader is the daemon's own path (`execute_plan`, `copy_segment`): a new memfd segment created, reserved, filled
and sealed, timed whole. Each figure is the median of `repeats` runs. The backbone is the store's (`--backbone`), or
with `--size-mb` a synthetic safetensors file of that size (64 MiB float32 tensors and a few small ones) written to a
scratch folder, since a 270 MB backbone is over in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec

from lorafaas import cuda_ipc
from lorafaas.backbone_daemon.loader import (
    LoadPlan,
    copy_reads,
    copy_segment,
    execute_plan,
    load_reads,
    plan_direct_load,
    plan_file_load,
)
from lorafaas.backbone_daemon.segment_fill import default_threads, fill
from lorafaas.cuda_ipc.memfd import MemfdExport
from lorafaas.formats.model_store import ModelStore
from lorafaas.progress import ProgressSink, SilentProgress

READ_BYTES = 16 * 1024 * 1024
GB = 1e9
_libc = ctypes.CDLL(None, use_errno=True)


class TierFigures(msgspec.Struct, frozen=True, kw_only=True):
    loader_gbps: float
    limit_gbps: float
    fraction_of_limit: float
    # the same copy into memory allocated by it (pages faulted in as it goes), as any loader that makes new memory
    new_memory_limit_gbps: float
    fraction_of_new_memory_limit: float
    # the loader's reads alone, into a segment reserved beforehand: what it costs beside the reservation (on a GPU
    # the target is device memory, where reserving is not paging in fresh host pages)
    fill_gbps: float
    fill_fraction_of_limit: float
    safetensors_gbps: float | None  # load_file of the same files, one byte of each page read (None: host tier)


class LoaderResult(msgspec.Struct, frozen=True, kw_only=True):
    source: str  # the backbone's name, or "synthetic"
    bytes_loaded: int
    repeats: int
    cold_dropped: bool  # every run's files were out of the page cache before it (mincore)
    cold_resident_fraction: float  # the largest fraction of the files still cached after a drop
    cold: TierFigures
    page_cache: TierFigures
    host_tier: TierFigures
    host_tier_adoption_ms: float  # a CPU daemon takes a kept segment as is: no byte copied


def run_loader_bench(store: ModelStore | None, backbone: str = "smollm2-135m", size_mb: int | None = None,
                     repeats: int = 3, progress: ProgressSink | None = None) -> LoaderResult:
    progress = progress or SilentProgress()
    with tempfile.TemporaryDirectory(prefix="lorafaas-bench-load-") as scratch:
        if size_mb is not None:
            progress.stage(f"writing a {size_mb} MB synthetic safetensors file")
            paths = [write_synthetic_file(Path(scratch) / "synthetic.safetensors", size_mb * 1024 * 1024)]
            plan, source = plan_file_load(paths), "synthetic"
        else:
            if store is None:
                raise ValueError("a store is needed to load a backbone")
            manifest = store.get(backbone)
            model_dir = store.path(manifest.name)
            paths = [model_dir / f for f in manifest.weight_files]
            plan, source = plan_direct_load(model_dir, paths), manifest.name
        size = sum(p.nbytes for p in plan.pieces)
        file_bytes = max(p.stat().st_size for p in paths)
        buffer = _allocate(max(file_bytes, size), prefault=True)  # the limits' preallocated buffer
        try:
            figures, resident = _measure(plan, paths, size, repeats, buffer, progress)
        finally:
            buffer.close()
    return LoaderResult(source=source, bytes_loaded=size, repeats=repeats,
                        cold_dropped=max(resident, default=1.0) < 0.05,
                        cold_resident_fraction=round(max(resident, default=1.0), 4),
                        cold=figures["cold"], page_cache=figures["page_cache"], host_tier=figures["host_tier"],
                        host_tier_adoption_ms=figures["adoption_ms"])


def _measure(plan: LoadPlan, paths: list[Path], size: int, repeats: int, buffer: mmap.mmap,
             progress: ProgressSink) -> tuple[dict, list[float]]:
    resident: list[float] = []

    def cold(reader: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            resident.append(drop_from_cache(paths))
            return reader()
        return run

    def fresh_read() -> object:
        return read_sequential(paths, None)

    progress.stage(f"cold: {repeats} run(s) of each reader, the files dropped from the page cache first")
    figures: dict = {"cold": _tier(size, repeats, cold(lambda: read_sequential(paths, buffer)),
                                   cold(lambda: _load(plan)), cold(lambda: _safetensors(paths)), cold(fresh_read),
                                   cold(lambda: _fill_only(plan, None)))}
    progress.stage("page cache: the same, every page cached")
    read_sequential(paths, buffer)
    figures["page_cache"] = _tier(size, repeats, lambda: read_sequential(paths, buffer), lambda: _load(plan),
                                  lambda: _safetensors(paths), fresh_read, lambda: _fill_only(plan, None))
    progress.stage("host tier: a new segment from a kept one, against a memcpy")
    held = execute_plan(plan, "cpu", "lorafaas-bench-held")
    try:
        fd, manifest = held.fd, held.manifest
        if fd is None:
            raise RuntimeError("the held segment has no descriptor")
        figures["host_tier"] = _tier(size, repeats, lambda: memcpy_segment(fd, manifest.size, buffer),
                                     lambda: _copy(manifest, fd), None, lambda: memcpy_segment(fd, manifest.size, None),
                                     lambda: _fill_only(None, (manifest, fd)))
        started = time.perf_counter()
        for _ in range(repeats):
            copy = os.dup(fd)
            MemfdExport.adopt(manifest, copy).destroy()  # what a CPU daemon does with a kept segment
        figures["adoption_ms"] = round((time.perf_counter() - started) / repeats * 1e3, 3)
    finally:
        held.destroy()
    return figures, resident


def _tier(size: int, repeats: int, limit: Callable[[], object], loader: Callable[[], object],
          safetensors: Callable[[], object] | None, fresh_limit: Callable[[], object],
          fill_only: Callable[[], object]) -> TierFigures:
    """Each repeat runs every reader once, in turn (a machine's load drifts: the figures of one repeat share it)."""
    readers = {"limit": limit, "loader": loader, "fresh": fresh_limit, "fill": fill_only}
    if safetensors is not None:
        readers["safetensors"] = safetensors
    rates: dict[str, list[float]] = {name: [] for name in readers}
    for _ in range(repeats):
        for name, run in readers.items():
            started = time.perf_counter()
            result = run()
            elapsed = result.seconds if isinstance(result, _Timed) else time.perf_counter() - started
            moved = result if isinstance(result, int) else size  # the limits say what they moved
            rates[name].append(moved / GB / elapsed)
            _release(result)
            del result  # a mapping still alive keeps its pages cached through the next cold run's drop
    median = {name: statistics.median(values) for name, values in rates.items()}
    return TierFigures(loader_gbps=round(median["loader"], 3), limit_gbps=round(median["limit"], 3),
                       fraction_of_limit=round(median["loader"] / median["limit"], 3),
                       new_memory_limit_gbps=round(median["fresh"], 3),
                       fraction_of_new_memory_limit=round(median["loader"] / median["fresh"], 3),
                       fill_gbps=round(median["fill"], 3),
                       fill_fraction_of_limit=round(median["fill"] / median["limit"], 3),
                       safetensors_gbps=round(median["safetensors"], 3) if "safetensors" in median else None)


def _release(result: object) -> None:
    destroy = getattr(result, "destroy", None)
    if callable(destroy):
        destroy()


@dataclass(frozen=True)
class _Timed:
    """A reader that timed itself: the part of its work the figure is about."""

    seconds: float


def _fill_only(plan: LoadPlan | None, source: tuple[cuda_ipc.SegmentManifest, int] | None) -> _Timed:
    """The loader's reads alone, into a segment reserved beforehand (untimed): from the plan's files, or `source`."""
    if plan is not None:
        specs = list(plan.specs)
    else:
        assert source is not None
        specs = [cuda_ipc.TensorSpec(e.name, e.dtype, e.shape) for e in source[0].tensors]
    segment = cuda_ipc.create(specs, "cpu", name="lorafaas-bench-fill")
    fds: dict = {}
    try:
        if plan is not None:
            reads = load_reads(plan, segment.manifest)
            fds = {path: os.open(path, os.O_RDONLY) for path in {p.file for p in plan.pieces}}
        else:
            assert source is not None
            reads, fds = copy_reads(source[0], segment.manifest), {0: os.dup(source[1])}
        started = time.perf_counter()
        fill(segment, reads, fds, default_threads("cpu"))
        return _Timed(time.perf_counter() - started)
    finally:
        for fd in fds.values():
            os.close(fd)
        segment.destroy()


def _load(plan: LoadPlan) -> object:
    return execute_plan(plan, "cpu", "lorafaas-bench-load")


def _copy(manifest, fd: int) -> object:
    return copy_segment(manifest, fd, "cpu", "lorafaas-bench-copy")


def _safetensors(paths: list[Path]) -> object:
    """load_file, then one byte of every page read: it maps the file and reads nothing until a tensor is used."""
    import torch
    from safetensors.torch import load_file

    loaded = [load_file(str(p)) for p in paths]
    step = mmap.PAGESIZE
    for tensors in loaded:
        for tensor in tensors.values():
            flat = tensor.reshape(-1).view(torch.uint8) if tensor.numel() else tensor
            if flat.numel():
                flat[::step].sum()
    return loaded


def read_sequential(paths: list[Path], buffer: mmap.mmap | None) -> int:
    """The dd-style limit: each file read front to back in 16 MiB reads into `buffer` (preallocated and pre-faulted),
    or with None into memory mapped for the call and faulted in as it is written."""
    total = 0
    for path in paths:
        size = path.stat().st_size
        target = buffer if buffer is not None else _allocate(size, prefault=False)
        with memoryview(target) as view, open(path, "rb", buffering=0) as f:
            done = 0
            while done < size:
                n = f.readinto(view[done:done + READ_BYTES])
                if not n:
                    break
                done += n
        if buffer is None:
            target.close()
        total += done
    return total


def memcpy_segment(fd: int, size: int, buffer: mmap.mmap | None) -> int:
    """The host tier's limit: one memcpy of a segment's bytes into `buffer` (None: new memory, as read_sequential)."""
    source = _private_mapping(fd, size)
    target = buffer if buffer is not None else _allocate(size, prefault=False)
    with _address_of(source) as source_address, _address_of(target) as target_address:
        ctypes.memmove(target_address, source_address, size)
    source.close()
    if buffer is None:
        target.close()
    return size


def _private_mapping(fd: int, size: int) -> mmap.mmap:
    """A copy-on-write mapping (writable to ctypes, never written): reads see the file's own pages, sealed or not."""
    return mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)


@contextlib.contextmanager
def _address_of(buffer: mmap.mmap) -> Iterator[int]:
    anchor = ctypes.c_char.from_buffer(buffer)
    try:
        yield ctypes.addressof(anchor)
    finally:
        del anchor  # the mapping can be closed again


def _allocate(size: int, *, prefault: bool) -> mmap.mmap:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (getattr(mmap, "MAP_POPULATE", 0) if prefault else 0)
    return mmap.mmap(-1, max(size, 1), flags)


def drop_from_cache(paths: list[Path]) -> float:
    """Drop the files from the page cache (fsync'd first: dirty pages cannot be dropped); the largest fraction of
    a file still resident afterwards (mincore), 0.0 when the drop worked."""
    worst = 0.0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            worst = max(worst, resident_fraction(fd, os.fstat(fd).st_size))
        finally:
            os.close(fd)
    return worst


def resident_fraction(fd: int, size: int) -> float:
    """The fraction of a file's pages in the page cache (mincore over a read-only mapping, which reads nothing)."""
    if size == 0:
        return 0.0
    page = mmap.PAGESIZE
    num_pages = -(-size // page)
    mapping = _private_mapping(fd, size)
    vector = (ctypes.c_ubyte * num_pages)()
    with _address_of(mapping) as address:
        failed = _libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector) != 0
    mapping.close()
    if failed:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in vector) / num_pages


def write_synthetic_file(path: Path, size: int) -> Path:
    """A safetensors file of about `size` bytes: 64 MiB float32 tensors, then small ones (biases, norms)."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    big = 16 * 1024 * 1024  # float32 elements: 64 MiB
    tensors: dict[str, torch.Tensor] = {}
    left = size
    index = 0
    while left > 0:
        elements = min(big, max(left // 4, 1))
        tensors[f"layer.{index}.weight"] = torch.rand(elements, generator=generator)
        tensors[f"layer.{index}.bias"] = torch.rand(577, generator=generator)  # odd sizes: unaligned offsets
        left -= elements * 4 + 577 * 4
        index += 1
    save_file(tensors, str(path))
    return path
