"""Linear weights packed for oneDNN in the segment, in place of the plain layout (lorafaas/models/packed_weights.py),
on the tiny dense backbone: what is packed, that a bound model and the shared pass's executor compute from the packed
bytes exactly what oneDNN computes from its own packed copy, and that nothing else may read them."""

from __future__ import annotations

import os

import msgspec
import pytest
import torch

from lorafaas import cuda_ipc
from lorafaas.backbone_daemon.group_weights import GroupWeights
from lorafaas.backbone_daemon.loader import copy_segment, load_into_segment
from lorafaas.errors import BindingFailed, MalformedModel, SegmentError
from lorafaas.formats.model_store import ModelStore
from lorafaas.models.base_pass_groups import backbone_groups
from lorafaas.models.binding import bind_backbone
from lorafaas.models.cpu_linear import LINEAR_KERNELS, PackedLinear
from lorafaas.models.packed_weights import packed_views, packing_available
from lorafaas.models.reference import load_backbone
from tests.support.packed_reference import packed_like_the_daemon

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch cannot view packed oneDNN weights")
IDS = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
PACKED = {f"model.layers.{i}.{name}.weight" for i in range(2)
          for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}


@pytest.fixture(scope="module")
def segments(tiny_store: ModelStore):
    """tiny-dense loaded twice: plain and packed."""
    manifest = tiny_store.get("tiny-dense")
    made = {pack: load_into_segment(tiny_store.path("tiny-dense"), manifest.weight_files, "cpu",
                                    f"lorafaas-test.packed-{pack}.{os.getpid()}", pack_linears=pack)
            for pack in (False, True)}
    yield made
    for segment in made.values():
        segment.destroy()


def _attach(segment: cuda_ipc.Export, manifest: cuda_ipc.SegmentManifest | None = None) -> cuda_ipc.Attachment:
    assert segment.fd is not None
    return cuda_ipc.attach(manifest or segment.manifest, segment.fd)


def test_the_linear_weights_take_the_plain_ones_place_and_only_theirs(segments) -> None:
    plain, packed = segments[False], segments[True]
    assert {e.name for e in packed.manifest.tensors if e.onednn_md is not None} == PACKED  # k/v would need padding
    assert packed.manifest.size == plain.manifest.size  # replaced, not beside: no byte more
    assert [(e.name, e.offset, e.nbytes) for e in packed.manifest.tensors] == \
        [(e.name, e.offset, e.nbytes) for e in plain.manifest.tensors]
    ours, theirs = _attach(packed).tensors, _attach(plain).tensors
    for name in ours:
        assert torch.equal(ours[name], theirs[name]) == (name not in PACKED), name  # the bytes really are repacked


def test_a_bound_model_computes_from_the_packed_bytes_what_onednn_computes_from_its_own_copy(
        segments, tiny_store: ModelStore) -> None:
    model_dir = tiny_store.path("tiny-dense")
    bound = bind_backbone(_attach(segments[True]), model_dir)
    kinds = {name: type(module) for name, module in bound.named_modules()}
    assert {f"{n}.weight" for n, kind in kinds.items() if kind is PackedLinear} == PACKED
    assert kinds["model.layers.0.self_attn.k_proj"] is torch.nn.Linear and kinds["lm_head"] is torch.nn.Linear
    reference = packed_like_the_daemon(load_backbone(model_dir)[0])
    plain = load_backbone(model_dir)[0]
    with torch.inference_mode():
        ours = bound(IDS).logits
        assert torch.equal(ours, reference(IDS).logits)  # bit for bit
        torch.testing.assert_close(ours, plain(IDS).logits, rtol=1e-4, atol=1e-5)  # float32 roundings only
        tokens = bound.generate(IDS, max_new_tokens=12, do_sample=False)
        assert torch.equal(tokens, plain.generate(IDS, max_new_tokens=12, do_sample=False))


def test_the_shared_pass_executor_computes_from_the_packed_bytes(segments, tiny_store: ModelStore) -> None:
    outputs = {}
    for pack, segment in segments.items():
        attachment = _attach(segment)
        groups = backbone_groups(bind_backbone(attachment, tiny_store.path("tiny-dense")), attachment.tensors)
        weights = GroupWeights({**attachment.tensors, **packed_views(attachment)}, groups, LINEAR_KERNELS["onednn"])
        assert weights.layer(0)[0][0].is_mkldnn == pack  # q (packed) leads the first group
        generator = torch.Generator().manual_seed(0)
        outputs[pack] = [weights.compute(key, torch.randn(8, weights.in_width(key), generator=generator))
                         for key in range(weights.num_groups)]
    for key, (plain, packed) in enumerate(zip(outputs[False], outputs[True], strict=True)):
        for a, b in zip(plain, packed, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=f"group {key}")


def test_a_packed_weight_held_by_anything_but_its_linear_layer_is_refused(segments, tiny_store: ModelStore) -> None:
    """An embedding table marked packed would be looked up as values it no longer holds: refused, not computed."""
    segment = segments[True]
    table = next(e for e in segment.manifest.tensors if e.name == "model.embed_tokens.weight")
    descriptor = torch.ops.mkldnn._get_mkldnn_serialized_md(
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(table.shape), 8)).numpy().tobytes()
    forged = msgspec.structs.replace(segment.manifest, tensors=tuple(
        msgspec.structs.replace(e, onednn_md=descriptor) if e is table else e for e in segment.manifest.tensors))
    with pytest.raises(BindingFailed, match=r"model\.embed_tokens\.weight.*only that weight's own linear layer"):
        bind_backbone(_attach(segment, forged), tiny_store.path("tiny-dense"))


def test_a_descriptor_that_does_not_fit_its_entry_is_refused(segments, tiny_store: ModelStore) -> None:
    segment = segments[True]
    q = next(e for e in segment.manifest.tensors if e.name == "model.layers.0.self_attn.q_proj.weight")
    wrong = torch.ops.mkldnn._get_mkldnn_serialized_md(
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(128, 64), 8)).numpy().tobytes()  # another shape
    forged = msgspec.structs.replace(segment.manifest, tensors=tuple(
        msgspec.structs.replace(e, onednn_md=wrong) if e is q else e for e in segment.manifest.tensors))
    with pytest.raises(SegmentError, match=r"q_proj\.weight.*does not fit its place"):
        packed_views(_attach(segment, forged))
    with pytest.raises(BindingFailed, match=r"does not fit its place"):
        bind_backbone(_attach(segment, forged), tiny_store.path("tiny-dense"))


def test_a_copy_keeps_the_packed_layout_on_a_cpu_and_is_refused_for_a_gpu(segments, tiny_store: ModelStore) -> None:
    segment = segments[True]
    assert segment.fd is not None
    with pytest.raises(MalformedModel, match="packed for oneDNN on a CPU; they cannot be copied to cuda:0"):
        copy_segment(segment.manifest, segment.fd, "cuda:0", "lorafaas-test.copy-gpu")
    copy = copy_segment(segment.manifest, segment.fd, "cpu", f"lorafaas-test.copy.{os.getpid()}")
    try:
        assert {e.name for e in copy.manifest.tensors if e.onednn_md is not None} == PACKED
        model_dir = tiny_store.path("tiny-dense")
        with torch.inference_mode():
            assert torch.equal(bind_backbone(_attach(copy), model_dir)(IDS).logits,
                               bind_backbone(_attach(segment), model_dir)(IDS).logits)
    finally:
        copy.destroy()
