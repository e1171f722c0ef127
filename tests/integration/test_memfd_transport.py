"""The sealed-memfd transport across real processes (the descriptor inherited, as it would arrive over a socket):
same bytes, no copy, writes fault the writer only."""

from __future__ import annotations

import signal
from pathlib import Path

import msgspec
import pytest
import torch

from lorafaas import cuda_ipc
from lorafaas.testing.attach_probe import ProbeProcess, tensors_digest


@pytest.fixture
def segment():
    g = torch.Generator().manual_seed(1)
    state = {
        "w": torch.randn(64, 48, generator=g),
        "b": torch.randn(48, generator=g).to(torch.bfloat16),
        "step": torch.tensor(7, dtype=torch.int64),
        "big": torch.randn(300_000, generator=g),  # spans many pages
    }
    exported = cuda_ipc.export(state, "cpu")
    yield state, exported
    exported.destroy()


def _probe_args(tmp_path: Path, exported) -> tuple[list[str], tuple[int, ...]]:
    path = tmp_path / "manifest.json"
    path.write_bytes(msgspec.json.encode(exported.manifest))
    return ["manifest", str(path), str(exported.fd)], (exported.fd,)


def _pss_shmem_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss_Shmem:"):
            return int(line.split()[1])
    raise AssertionError("no Pss_Shmem line")


def test_other_processes_see_the_same_bytes_in_the_segment(segment, tmp_path: Path) -> None:
    state, exported = segment
    args, fds = _probe_args(tmp_path, exported)
    with ProbeProcess(args, timeout_s=60, pass_fds=fds) as a, ProbeProcess(args, pass_fds=fds) as b:
        ra, rb = a.wait_report(), b.wait_report()
        assert ra.tensors_sha256 == rb.tensors_sha256 == tensors_digest(state)
        assert ra.params_in_segment and rb.params_in_segment and ra.segment_size == exported.manifest.size
        # both touched every page once: the segment's pages are shared, each process is charged about half
        total_kb = _pss_shmem_kb(a.pid) + _pss_shmem_kb(b.pid)
        assert abs(total_kb * 1024 - exported.manifest.size) <= 0.1 * exported.manifest.size + 16 * 1024


def test_a_write_through_an_attachment_faults_the_writer_and_nobody_else(segment, tmp_path: Path) -> None:
    state, exported = segment
    args, fds = _probe_args(tmp_path, exported)
    with ProbeProcess(args, timeout_s=60, pass_fds=fds) as writer, ProbeProcess(args, pass_fds=fds) as other:
        writer.wait_report()
        before = other.wait_report()
        writer.send("write")
        assert writer.wait_exit() == -signal.SIGSEGV
        assert other.request("report").tensors_sha256 == before.tensors_sha256 == tensors_digest(state)
    mine = cuda_ipc.attach(exported.manifest, exported.fd)
    try:
        assert tensors_digest(mine.tensors) == tensors_digest(state)
    finally:
        mine.close()
