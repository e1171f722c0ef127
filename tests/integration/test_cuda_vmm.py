"""The GPU transport on a real GPU: a CUDA VMM allocation exported as a POSIX descriptor, imported read-only by
other processes, and the daemon's whole path (create -> fill -> export -> import -> bind -> generate), compared with a
private load on the same GPU.

Runs only where torch sees CUDA and the driver exports VMM allocations as descriptors; elsewhere every test is
skipped with the reason. scripts/gpu-check.sh runs it on a GPU machine (docs/sharing.md, "The GPU check").
"""

from __future__ import annotations

import signal
from pathlib import Path

import msgspec
import pytest
import torch

from lorafaas import cuda_ipc
from lorafaas.errors import SegmentError
from lorafaas.formats.model_store import ModelStore
from lorafaas.models.reference import load_backbone
from lorafaas.protocols.daemon_client import DaemonClient, spawn_daemon, stop_daemon
from lorafaas.protocols.daemon_config import DaemonConfig
from lorafaas.testing.attach_probe import PROBE_THREADS, ProbeProcess, logits_digest, tensors_digest


def _cuda_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "CUDA is not available (torch sees no GPU)"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_cuda_skip_reason() is not None, reason=_cuda_skip_reason() or "")]


@pytest.fixture
def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return {"w": torch.randn(128, 64, generator=g), "b": torch.randn(64, generator=g).to(torch.bfloat16),
            "n": torch.arange(5)}


def _probe_args(tmp_path: Path, exported) -> tuple[list[str], tuple[int, ...]]:
    path = tmp_path / "manifest.json"
    path.write_bytes(msgspec.json.encode(exported.manifest))
    return ["manifest", str(path), str(exported.fd)], (exported.fd,)


def test_another_process_imports_the_descriptor_read_only_and_a_write_faults_only_the_writer(state, tmp_path) -> None:
    exported = cuda_ipc.export(state, "cuda:0")
    try:
        manifest = exported.manifest
        assert manifest.transport == "cuda_vmm" and manifest.location.device_uuid.startswith("GPU-")
        assert manifest.location.allocation_size >= manifest.size
        with pytest.raises(SegmentError, match="sealed"):
            exported.writable_views()  # the owner keeps no mapping once sealed
        args, fds = _probe_args(tmp_path, exported)
        with ProbeProcess(args, timeout_s=120, pass_fds=fds) as writer, \
                ProbeProcess(args, timeout_s=120, pass_fds=fds) as reader:
            assert writer.wait_report().tensors_sha256 == reader.wait_report().tensors_sha256 == tensors_digest(state)
            writer.send("write")  # a kernel writing a read-only mapping: the writer's context fails
            assert writer.wait_exit(60) != 0
            assert reader.request("report").tensors_sha256 == tensors_digest(state)
    finally:
        exported.destroy()


def test_a_manifest_naming_another_gpu_is_refused(state) -> None:
    exported = cuda_ipc.export(state, "cuda:0")
    try:
        other = msgspec.structs.replace(exported.manifest.location, device_uuid="GPU-00000000-0000-0000-0000-0")
        with pytest.raises(SegmentError, match="this process sees"):
            cuda_ipc.attach(msgspec.structs.replace(exported.manifest, location=other), exported.fd)
    finally:
        exported.destroy()


def test_the_daemons_gpu_path_binds_and_generates_like_a_private_load(tmp_path, tiny_dense_dir) -> None:
    ModelStore(tmp_path / "models").import_dir("tiny-dense", tiny_dense_dir)
    config = DaemonConfig(home=tmp_path, backbone="tiny-dense", device="cuda:0")
    with (tmp_path / "daemon.log").open("ab") as log:
        process = spawn_daemon(config, timeout_s=300, stderr=log)
    try:
        threads = torch.get_num_threads()
        torch.set_num_threads(PROBE_THREADS)
        try:
            private, _ = load_backbone(tiny_dense_dir)
            reference = logits_digest(private.to("cuda:0"))
        finally:
            torch.set_num_threads(threads)
        with ProbeProcess(["daemon", str(config.paths.socket), "fn-gpu"], timeout_s=300) as probe:
            report = probe.wait_report()
            assert report.params_in_segment and report.logits_sha256 == reference
            probe.send("write")
            assert probe.wait_exit(60) not in (0, None) or probe.wait_exit(60) == -signal.SIGSEGV
        with DaemonClient.connect(config.paths.socket) as client:
            assert client.status().transport == "cuda_vmm"
    finally:
        if process.poll() is None:
            stop_daemon(process, config.paths.socket, force=True)
