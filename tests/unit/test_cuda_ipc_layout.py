"""Segment layout, manifest checks and an export/attach round trip within one process (CPU transport)."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest
import torch

from lorafaas import cuda_ipc
from lorafaas.cuda_ipc.layout import TensorSpec, check_manifest, plan_layout
from lorafaas.cuda_ipc.messages import CudaIpcLocation, SegmentManifest, ShmLocation, TensorEntry
from lorafaas.cuda_ipc.shm import SHM_DIR
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
    return SegmentManifest(device="cpu", location=ShmLocation(name="x"), size=size, alignment=256, tensors=entries)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (TensorEntry(name="a", dtype="float32", shape=(4,), offset=8, nbytes=16), "unaligned"),
        (TensorEntry(name="a", dtype="float32", shape=(4,), offset=0, nbytes=12), "needs 16 bytes"),
        (TensorEntry(name="a", dtype="float32", shape=(200,), offset=256, nbytes=800), "ends at byte 1056"),
        (TensorEntry(name="a", dtype="complex32", shape=(1,), offset=0, nbytes=4), "unknown dtype"),
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
    with pytest.raises(SegmentError, match="format version 2"):
        check_manifest(msgspec.structs.replace(_manifest(b), format_version=2))
    check_manifest(_manifest(b))  # the same table without the overlap is fine


def test_manifests_round_trip_through_msgpack_and_json_with_their_transport_tag() -> None:
    cuda = SegmentManifest(device="cuda:1", location=CudaIpcLocation(handle=bytes(range(64)), device_index=1,
                                                                    owner_pid=42), size=256, alignment=256, tensors=())
    for manifest in (_manifest(), cuda):
        for codec in (msgspec.msgpack, msgspec.json):
            decoded = codec.decode(codec.encode(manifest), type=SegmentManifest)
            assert decoded == manifest
    assert _manifest().transport == "shm" and cuda.transport == "cuda_ipc"
    assert b'"transport":"cuda_ipc"' in msgspec.json.encode(cuda)


def test_round_trip_gives_equal_tensors_viewing_one_segment(exported) -> None:
    source = _state_dict()
    attachment = cuda_ipc.attach(exported.manifest)
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


def test_the_owner_holds_no_mapping_after_sealing_and_destroy_unlinks(exported) -> None:
    name = exported.manifest.location.name
    assert (SHM_DIR / name).stat().st_size == exported.manifest.size
    maps = Path(f"/proc/{os.getpid()}/maps").read_text()
    assert name not in maps
    with pytest.raises(SegmentError, match="sealed"):
        exported.writable_views()
    exported.destroy()
    assert not (SHM_DIR / name).exists()
    with pytest.raises(SegmentError, match="does not exist"):
        cuda_ipc.attach(exported.manifest)


def test_attach_refuses_a_segment_of_another_size(exported) -> None:
    wrong = msgspec.structs.replace(exported.manifest, size=exported.manifest.size * 2)
    with pytest.raises(SegmentError, match="manifest says"):
        cuda_ipc.attach(wrong)


def test_unknown_devices_are_refused() -> None:
    with pytest.raises(TransportUnavailable, match="tpu"):
        cuda_ipc.export({"a": torch.zeros(1)}, "tpu:0")
