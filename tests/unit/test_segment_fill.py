"""The loader's reads: planned as few large vectored reads, run on threads, every byte placed once and exactly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lorafaas import cuda_ipc
from lorafaas.backbone_daemon import segment_fill
from lorafaas.backbone_daemon.loader import copy_segment, execute_plan, plan_file_load
from lorafaas.backbone_daemon.segment_fill import Placement, SpanRead, fill, plan_reads
from lorafaas.errors import SegmentError


def test_file_consecutive_placements_become_one_read_into_several_spans() -> None:
    reads = plan_reads([Placement("f", 100, 0, 10), Placement("f", 110, 64, 5), Placement("f", 115, 69, 3)],
                       chunk_bytes=1 << 20)
    assert reads == [SpanRead("f", 100, ((0, 10), (64, 8)))]  # the last two are contiguous in the segment too


def test_reads_stop_at_chunk_boundaries_and_gaps_and_cover_every_byte_once() -> None:
    placements = [Placement("a", 3, 0, 20), Placement("a", 23, 128, 9), Placement("a", 40, 256, 4),
                  Placement("b", 0, 512, 17)]
    reads = plan_reads(placements, chunk_bytes=8)
    assert all(r.file_offset // 8 == (r.file_offset + r.nbytes - 1) // 8 for r in reads)  # none crosses a chunk
    placed = sorted((r.source, r.file_offset + sum(n for _o, n in r.spans[:i]), o, n)
                    for r in reads for i, (o, n) in enumerate(r.spans))
    expanded = sorted((s, f + k, o + k) for s, f, o, n in placed for k in range(n))
    expected = sorted((p.source, p.file_offset + k, p.segment_offset + k) for p in placements for k in range(p.nbytes))
    assert expanded == expected
    assert len([r for r in reads if r.source == "a" and r.file_offset == 40]) == 1  # the gap at 32..40 splits


def _write(path: Path) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    tensors = {f"t{i}": torch.rand(n, generator=generator) for i, n in enumerate([3, 70001, 5, 4096, 123457, 1])}
    tensors["half"] = torch.rand(333, generator=generator).to(torch.bfloat16)
    save_file(tensors, str(path))
    return tensors


@pytest.mark.parametrize("threads", [1, 4])
def test_a_threaded_load_in_small_chunks_is_bitwise_the_file(tmp_path: Path, threads: int,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    expected = _write(tmp_path / "w.safetensors")
    monkeypatch.setattr(segment_fill, "CHUNK_BYTES", 4096)  # many reads, many ending mid-tensor
    monkeypatch.setattr(segment_fill, "DEFAULT_THREADS", threads)
    segment = execute_plan(plan_file_load([tmp_path / "w.safetensors"]), "cpu", "test-fill")
    try:
        attachment = cuda_ipc.attach(segment.manifest, segment.fd)
        for name, tensor in expected.items():
            assert torch.equal(attachment.tensors[name], tensor), name
        copy = copy_segment(segment.manifest, segment.fd, "cpu", "test-copy", num_threads=threads)
        copied = cuda_ipc.attach(copy.manifest, copy.fd)
        assert all(torch.equal(copied.tensors[n], t) for n, t in expected.items())
        assert copy.manifest.location.inode != segment.manifest.location.inode
        copied.close()
        copy.destroy()
        attachment.close()
    finally:
        segment.destroy()


def test_a_read_past_the_segment_or_the_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 100)
    segment = cuda_ipc.create([cuda_ipc.TensorSpec("a", "uint8", (200,))], "cpu", name="test-refuse")
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(SegmentError, match="outside segment"):
            fill(segment, [SpanRead(0, 0, ((segment.manifest.size - 10, 20),))], {0: fd})
        with pytest.raises(SegmentError, match="file ended 100 bytes early"):
            fill(segment, [SpanRead(0, 0, ((0, 200),))], {0: fd})
        segment.seal()
        with pytest.raises(SegmentError, match="sealed"):
            fill(segment, [SpanRead(0, 0, ((0, 10),))], {0: fd})
    finally:
        os.close(fd)
        segment.destroy()


def test_without_proc_the_segment_is_filled_through_its_mapping(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Where /proc/self/fd cannot be reopened (no /proc in a sandbox) the reads go into the writable mapping."""
    expected = _write(tmp_path / "w.safetensors")
    real_open = os.open

    def no_proc(path, *args, **kwargs):
        if str(path).startswith("/proc/self/fd/"):
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_proc)
    monkeypatch.setattr(segment_fill, "CHUNK_BYTES", 4096)
    segment = execute_plan(plan_file_load([tmp_path / "w.safetensors"]), "cpu", "test-no-proc")
    try:
        attachment = cuda_ipc.attach(segment.manifest, segment.fd)
        assert all(torch.equal(attachment.tensors[n], t) for n, t in expected.items())
        attachment.close()
    finally:
        segment.destroy()
