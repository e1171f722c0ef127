"""Segment layout, manifest checks and an export/attach round trip within one process (CPU transport)."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest
import torch

from lorafaas import cuda_ipc
from lorafaas.cuda_ipc.layout import TensorSpec, check_manifest, plan_layout
from lorafaas.cuda_ipc.memfd import available_memory_bytes
from lorafaas.cuda_ipc.messages import CudaVmmLocation, MemfdLocation, SegmentManifest, TensorEntry
from lorafaas.errors import SegmentError, TransportUnavailable


def _state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(7, 5, generator=g),  # 140 bytes: the next tensor needs padding
        "norm.weight": torch.randn(5, generator=g).to(torch.bfloat16),
        "ids": torch.arange(3, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float16),
        "empty": torch.empty(0, 4),
    }


@pytest.fixture
def exported():
    segment = cuda_ipc.export(_state_dict(), "cpu")
    yield segment
    segment.destroy()


def test_layout_aligns_every_tensor_and_packs_them_in_order() -> None:
    specs = [TensorSpec("a", "float32", (7, 5)), TensorSpec("b", "bfloat16", (3,)), TensorSpec("c", "int8", (300,))]
    entries, size = plan_layout(specs, alignment=64)
    assert [e.name for e in entries] == ["a", "b", "c"]
    assert [e.offset for e in entries] == [0, 192, 256]  # 140 -> 192, 192 + 6 -> 256
    assert [e.nbytes for e in entries] == [140, 6, 300]
    assert size == 576 and size % 64 == 0
    assert all(e.offset % 64 == 0 for e in entries)


def test_layout_refuses_duplicates_bad_alignment_and_unknown_dtypes() -> None:
    with pytest.raises(SegmentError, match="twice"):
        plan_layout([TensorSpec("a", "float32", (1,)), TensorSpec("a", "float32", (1,))])
    with pytest.raises(ValueError, match="power of two"):
        plan_layout([TensorSpec("a", "float32", (1,))], alignment=48)
    with pytest.raises(SegmentError, match="complex64"):
        plan_layout([TensorSpec("a", "complex64", (1,))])


def _manifest(*entries: TensorEntry, size: int = 512) -> SegmentManifest:
    return SegmentManifest(device="cpu", location=MemfdLocation(label="x", inode=1), size=size, alignment=256,
                           tensors=entries)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (TensorEntry(name="a", dtype="float32", shape=(4,), offset=8, nbytes=16), "unaligned"),
        (TensorEntry(name="a", dtype="float32", shape=(4,), offset=0, nbytes=12), "needs 16 bytes"),
        (TensorEntry(name="a", dtype="float32", shape=(200,), offset=256, nbytes=800), "ends at byte 1056"),
        (TensorEntry(name="a", dtype="complex32", shape=(1,), offset=0, nbytes=4), "unknown dtype"),
        # only a 2-D float weight can be packed for oneDNN, with a descriptor of bounded size
        (TensorEntry(name="a", dtype="float32", shape=(4,), offset=0, nbytes=16, onednn_md=b"x"), "marked packed"),
        (TensorEntry(name="a", dtype="int32", shape=(2, 2), offset=0, nbytes=16, onednn_md=b"x"), "marked packed"),
        (TensorEntry(name="a", dtype="float32", shape=(2, 2), offset=0, nbytes=16, onednn_md=b""), "marked packed"),
        (TensorEntry(name="a", dtype="float32", shape=(2, 2), offset=0, nbytes=16, onednn_md=bytes(4097)),
         "4097-byte descriptor"),
    ],
)
def test_check_manifest_refuses_tables_that_would_escape_the_segment(entry: TensorEntry, message: str) -> None:
    with pytest.raises(SegmentError, match=message):
        check_manifest(_manifest(entry))


def test_check_manifest_refuses_overlaps_and_other_versions() -> None:
    a = TensorEntry(name="a", dtype="float32", shape=(100,), offset=0, nbytes=400)
    b = TensorEntry(name="b", dtype="float32", shape=(1,), offset=256, nbytes=4)
    with pytest.raises(SegmentError, match="overlaps"):
        check_manifest(_manifest(a, b))
    with pytest.raises(SegmentError, match="format version 1"):
        check_manifest(msgspec.structs.replace(_manifest(b), format_version=1))
    check_manifest(_manifest(b))  # the same table without the overlap is fine


def test_manifests_round_trip_through_msgpack_and_json_with_their_transport_tag() -> None:
    cuda = SegmentManifest(device="cuda:1", location=CudaVmmLocation(device_uuid="GPU-0f", allocation_size=2 << 20),
                           size=256, alignment=256, tensors=())
    packed = _manifest(TensorEntry(name="w", dtype="float32", shape=(2, 2), offset=0, nbytes=16, onednn_md=b"\x00md"))
    for manifest in (_manifest(), cuda, packed):
        for codec in (msgspec.msgpack, msgspec.json):
            decoded = codec.decode(codec.encode(manifest), type=SegmentManifest)
            assert decoded == manifest
    assert _manifest().transport == "memfd" and cuda.transport == "cuda_vmm"
    assert b'"transport":"cuda_vmm"' in msgspec.json.encode(cuda)


def test_round_trip_gives_equal_tensors_viewing_one_segment(exported) -> None:
    source = _state_dict()
    attachment = cuda_ipc.attach(exported.manifest, exported.fd)
    try:
        assert set(attachment.tensors) == set(source)
        for name, tensor in attachment.tensors.items():
            assert tensor.dtype == source[name].dtype and tensor.shape == source[name].shape
            assert torch.equal(tensor, source[name]), name
            assert attachment.contains(tensor)
            if tensor.numel():
                assert tensor.untyped_storage().data_ptr() == attachment.base_ptr  # a view, not a copy
        offsets = {e.name: e.offset for e in exported.manifest.tensors}
        assert attachment.tensors["norm.weight"].data_ptr() == attachment.base_ptr + offsets["norm.weight"]
        assert not attachment.contains(source["embed.weight"])
    finally:
        attachment.close()


def test_the_owner_holds_no_mapping_after_sealing_and_the_file_is_sealed(exported) -> None:
    label = exported.manifest.location.label
    assert os.fstat(exported.fd).st_size == exported.manifest.size
    assert f"/memfd:{label}" not in Path(f"/proc/{os.getpid()}/maps").read_text()
    assert not (Path("/dev/shm") / label).exists()  # no name anywhere
    with pytest.raises(SegmentError, match="sealed"):
        exported.writable_views()
    with pytest.raises(PermissionError):
        os.pwrite(exported.fd, b"x", 0)


def test_attach_refuses_a_descriptor_that_is_not_the_manifests_sealed_file(exported) -> None:
    wrong = msgspec.structs.replace(exported.manifest, size=exported.manifest.size * 2)
    with pytest.raises(SegmentError, match="manifest says"):
        cuda_ipc.attach(wrong, exported.fd)
    other = cuda_ipc.export({"x": torch.zeros(3)}, "cpu")
    unsealed = os.memfd_create("unsealed", os.MFD_ALLOW_SEALING)
    try:
        with pytest.raises(SegmentError, match="inode"):
            cuda_ipc.attach(exported.manifest, other.fd)
        location = msgspec.structs.replace(exported.manifest.location, inode=os.fstat(unsealed).st_ino)
        os.ftruncate(unsealed, exported.manifest.size)
        with pytest.raises(SegmentError, match="not sealed"):
            cuda_ipc.attach(msgspec.structs.replace(exported.manifest, location=location), unsealed)
    finally:
        other.destroy()
        os.close(unsealed)


def test_available_memory_is_the_lower_of_meminfo_and_the_cgroup_headroom(tmp_path: Path) -> None:
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal: 100 kB\nMemAvailable:   1000 kB\n")
    (proc / "self" / "cgroup").write_text("0::/pod\n")
    (root / "pod").mkdir(parents=True)
    (root / "pod" / "memory.max").write_text("max\n")
    (root / "pod" / "memory.current").write_text("5\n")
    assert available_memory_bytes(proc, root) == 1_024_000
    (root / "pod" / "memory.max").write_text("204805\n")
    assert available_memory_bytes(proc, root) == 204_800  # v2: max - current
    (proc / "self" / "cgroup").write_text("4:memory:/job\n")
    (root / "memory" / "job").mkdir(parents=True)
    (root / "memory" / "job" / "memory.limit_in_bytes").write_text(str(2**63 - 4096))
    (root / "memory" / "job" / "memory.usage_in_bytes").write_text("7")
    assert available_memory_bytes(proc, root) == 1_024_000  # v1 without a limit
    (root / "memory" / "job" / "memory.limit_in_bytes").write_text("107")
    assert available_memory_bytes(proc, root) == 100


def test_unknown_devices_are_refused() -> None:
    with pytest.raises(TransportUnavailable, match="tpu"):
        cuda_ipc.export({"a": torch.zeros(1)}, "tpu:0")
