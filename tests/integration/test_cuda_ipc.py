"""The CUDA IPC transport: export on a GPU, attach from another process, compare with plain torch.

Runs only where CUDA and cupy are present; elsewhere every test is skipped with the reason.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from lorafaas import cuda_ipc
from lorafaas.testing.attach_probe import ProbeProcess, tensors_digest


def _cuda_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "CUDA is not available (torch sees no GPU)"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "cupy is not installed (pip install 'lorafaas[gpu]')"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_cuda_skip_reason() is not None,
                                                   reason=_cuda_skip_reason() or "")]


@pytest.fixture
def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return {"w": torch.randn(128, 64, generator=g), "b": torch.randn(64, generator=g).to(torch.bfloat16),
            "n": torch.arange(5)}


def test_export_lays_tensors_in_one_device_allocation_equal_to_torch(state) -> None:
    exported = cuda_ipc.export(state, "cuda:0")
    try:
        manifest = exported.manifest
        assert manifest.transport == "cuda_ipc" and len(manifest.location.handle) == 64
        views = exported.writable_views()
        base = min(v.data_ptr() for v in views.values())
        for name, tensor in state.items():
            assert views[name].is_cuda and torch.equal(views[name].cpu(), tensor)
            assert views[name].data_ptr() - base == {e.name: e.offset for e in manifest.tensors}[name]
        del views
    finally:
        exported.destroy()


def test_another_process_attaches_through_one_handle_and_sees_the_same_bytes(state, tmp_path: Path) -> None:
    exported = cuda_ipc.export(state, "cuda:0")
    try:
        path = tmp_path / "manifest.json"
        path.write_bytes(msgspec.json.encode(exported.manifest))
        with ProbeProcess(["manifest", str(path)], timeout_s=120) as probe:
            report = probe.wait_report()
            assert report.params_in_segment
            assert report.tensors_sha256 == tensors_digest(state)
            probe.request("detach")  # closes the IPC handle
    finally:
        exported.destroy()
