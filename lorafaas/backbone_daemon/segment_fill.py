"""Filling a segment from files: a load's placements planned as few large vectored reads, run on a few threads.

A load is a list of placements (bytes of a source file -> a place in the segment). Placements that follow each other
in a file become one read of consecutive file bytes into several segment spans (one `preadv`, an iovec per span);
every read stays inside one chunk of the file (`CHUNK_BYTES`, counted from the file's start, so reads are large and
start on chunk boundaries wherever a tensor allows). The reads go to `num_threads` threads in file order: `preadv`
releases the GIL, so the copies out of the page cache (or the disk's reads) overlap, and the kernel's readahead
follows the threads' progress through the file. No byte passes through an intermediate buffer on the CPU (a GPU's
transport has its one pinned staging buffer and takes its reads one at a time).
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from lorafaas import cuda_ipc

CHUNK_BYTES = 16 * 1024 * 1024
MAX_SPANS_PER_READ = 1024  # IOV_MAX
DEFAULT_THREADS = 4  # past the memory bandwidth a few threads saturate, more only add contention


@dataclass(frozen=True)
class Placement:
    """`nbytes` of file `source` from `file_offset` on belong at `segment_offset`."""

    source: Hashable
    file_offset: int
    segment_offset: int
    nbytes: int


@dataclass(frozen=True)
class SpanRead:
    """One vectored read: consecutive bytes of `source` from `file_offset` on, into the segment's `spans` in turn."""

    source: Hashable
    file_offset: int
    spans: tuple[tuple[int, int], ...]  # (segment offset, nbytes)

    @property
    def nbytes(self) -> int:
        return sum(n for _offset, n in self.spans)


def plan_reads(placements: Iterable[Placement], chunk_bytes: int | None = None) -> list[SpanRead]:
    """The reads that place every byte once: file-consecutive placements merged, none crossing a chunk boundary."""
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    by_source: dict[Hashable, list[Placement]] = defaultdict(list)
    for placement in placements:
        if placement.nbytes:
            by_source[placement.source].append(placement)
    reads: list[SpanRead] = []
    for source, members in by_source.items():
        start = end = -1
        spans: list[tuple[int, int]] = []
        for placement in sorted(members, key=lambda p: p.file_offset):
            file_offset, segment_offset, left = placement.file_offset, placement.segment_offset, placement.nbytes
            while left:
                take = min(left, chunk_bytes - file_offset % chunk_bytes)  # up to the next chunk boundary
                joins = (spans and file_offset == end and file_offset // chunk_bytes == start // chunk_bytes
                         and len(spans) < MAX_SPANS_PER_READ)
                if not joins:
                    if spans:
                        reads.append(SpanRead(source, start, tuple(spans)))
                    start, spans = file_offset, []
                if spans and spans[-1][0] + spans[-1][1] == segment_offset:  # contiguous in the segment too
                    spans[-1] = (spans[-1][0], spans[-1][1] + take)
                else:
                    spans.append((segment_offset, take))
                end = file_offset + take
                file_offset, segment_offset, left = file_offset + take, segment_offset + take, left - take
        if spans:
            reads.append(SpanRead(source, start, tuple(spans)))
    return reads


def fill(segment: cuda_ipc.Export, reads: list[SpanRead], fds: Mapping[Any, int],
         num_threads: int = DEFAULT_THREADS) -> None:
    """Run `reads` into `segment` (`fds`: an open descriptor per source), on up to `num_threads` threads."""
    def run(read: SpanRead) -> None:
        segment.read_spans(fds[read.source], read.file_offset, read.spans)

    if num_threads <= 1 or len(reads) <= 1:
        for read in reads:
            run(read)
        return
    with ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="segment-fill") as pool:
        for _ in pool.map(run, reads):  # in order; the first failure is raised (the rest still finish or fail)
            pass


def default_threads(device: str) -> int:
    """Threads for filling a segment on `device`: a few on the CPU; one for a GPU (its staging buffer serialises)."""
    return min(DEFAULT_THREADS, os.cpu_count() or 1) if device == "cpu" else 1
