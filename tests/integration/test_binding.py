"""Loading a store backbone into a segment and binding a model to it, in one process, on the tiny backbones.

Bitwise equality with a private `from_pretrained` is the contract: same logits, not merely close ones.
"""

from __future__ import annotations

import os

import pytest
import torch

from lorafaas import cuda_ipc
from lorafaas.backbone_daemon.loader import load_into_segment, plan_direct_load
from lorafaas.errors import BindingFailed
from lorafaas.formats.model_store import ModelStore
from lorafaas.models.binding import bind_backbone, build_empty_model, check_bound
from lorafaas.models.reference import load_backbone
from lorafaas.testing.attach_probe import logits_digest


@pytest.fixture(params=["tiny-dense", "tiny-moe"])
def shared(request, tiny_store: ModelStore):
    name = request.param
    manifest = tiny_store.get(name)
    segment = load_into_segment(tiny_store.path(name), manifest.weight_files, "cpu",
                                f"lorafaas-test.{name}.{os.getpid()}")
    attachment = cuda_ipc.attach(segment.manifest, segment.fd)
    yield name, tiny_store.path(name), segment, attachment
    attachment.close()
    segment.destroy()


def test_bound_model_gives_bitwise_equal_logits_to_a_private_load(shared) -> None:
    name, model_dir, _segment, attachment = shared
    bound = bind_backbone(attachment, model_dir)
    private, _tokenizer = load_backbone(model_dir)
    assert logits_digest(bound) == logits_digest(private), name
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.inference_mode():
        assert torch.equal(bound(ids).logits, private(ids).logits)


def test_every_parameter_lies_in_the_segment_and_tied_weights_share_it(shared) -> None:
    _name, model_dir, segment, attachment = shared
    bound = bind_backbone(attachment, model_dir)
    params = dict(bound.named_parameters())
    assert params and all(attachment.contains(p) for p in params.values())
    assert all(not p.requires_grad for p in params.values())
    assert bound.lm_head.weight is bound.model.embed_tokens.weight  # tied: one shared tensor, not a copy
    assert "lm_head.weight" not in {e.name for e in segment.manifest.tensors}
    buffers = dict(bound.named_buffers())
    assert buffers and all(not b.is_meta and not attachment.contains(b) for b in buffers.values())


def test_fused_experts_are_placed_straight_from_the_checkpoint(tiny_store: ModelStore) -> None:
    model_dir = tiny_store.path("tiny-moe")
    plan = plan_direct_load(model_dir, [model_dir / f for f in tiny_store.get("tiny-moe").weight_files])
    fused = [p for p in plan.pieces if p.target.endswith("experts.gate_up_proj")]
    assert fused, "the Mixtral checkpoint's w1/w3 should be placed into the fused gate_up_proj"
    # each expert contributes w1 then w3, back to back: the offsets tile the fused tensor with no gap
    layer0 = sorted(p.target_offset for p in fused if p.target.startswith("model.layers.0."))
    size = fused[0].nbytes
    assert layer0 == [i * size for i in range(len(layer0))]


def test_check_bound_catches_a_parameter_outside_the_segment(shared) -> None:
    _name, model_dir, _segment, attachment = shared
    bound = bind_backbone(attachment, model_dir)
    norm = bound.model.norm
    norm.weight = torch.nn.Parameter(norm.weight.detach().clone(), requires_grad=False)  # a private copy
    with pytest.raises(BindingFailed, match=r"model\.norm\.weight"):
        check_bound(bound, attachment)


def test_binding_another_backbones_segment_is_refused(tiny_store: ModelStore) -> None:
    manifest = tiny_store.get("tiny-moe")
    segment = load_into_segment(tiny_store.path("tiny-moe"), manifest.weight_files, "cpu",
                                f"lorafaas-test.mismatch.{os.getpid()}")
    try:
        with pytest.raises(BindingFailed, match=r"no module|no such parameter"):
            bind_backbone(cuda_ipc.attach(segment.manifest, segment.fd), tiny_store.path("tiny-dense"))
    finally:
        segment.destroy()


def test_an_empty_model_has_no_real_parameters(tiny_store: ModelStore) -> None:
    model = build_empty_model(tiny_store.path("tiny-dense"))
    assert all(p.is_meta for p in model.parameters())
    assert not model.training


def test_the_lm_head_of_a_bound_model_gets_an_input_matmul_can_fold(shared) -> None:
    """transformers hands the head `hidden_states[:, -1:, :]`, a strided view. With bound parameters (no gradient)
    torch's matmul then ran a batched product over an expanded weight, a plain loop in bf16 on a CPU: 157 ms against
    5 ms for SmolLM2's head. The bound model's head now gets a copy whose strides nest, and the logits stay equal."""
    name, model_dir, _segment, attachment = shared
    bound = bind_backbone(attachment, model_dir)
    seen: list[tuple[int, ...]] = []
    head = bound.get_output_embeddings()
    head.register_forward_pre_hook(lambda _m, args: seen.append(tuple(args[0].stride())) or None)  # runs after ours
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    private, _tokenizer = load_backbone(model_dir)  # its parameters need a gradient: matmul folds there
    with torch.inference_mode():
        ours, theirs = bound(ids, logits_to_keep=1).logits, private(ids, logits_to_keep=1).logits
    assert seen[0] == (head.in_features, head.in_features, 1), name  # [1, 1, d] with the strides of its shape
    assert torch.equal(ours, theirs), name  # the same product as a private load's, bit for bit


def test_a_private_load_is_aligned_as_a_bound_one_and_keeps_its_ties(tiny_store: ModelStore) -> None:
    """from_pretrained leaves tensors where the checkpoint's mapping has them (the tiny file: 24 bytes past a 64-byte
    boundary), and a float32 product there rounds differently on an AVX-512 AMD EPYC than from the segment."""
    model, _ = load_backbone(tiny_store.path("tiny-dense"))
    assert all(t.data_ptr() % 64 == 0 for t in [*model.parameters(), *model.buffers()] if t.numel())
    assert model.lm_head.weight is model.model.embed_tokens.weight
