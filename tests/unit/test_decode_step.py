"""The decode step outside HF's module plumbing computes HF's logits and cache bit for bit, and steps aside for a model
it cannot run."""

import copy

import pytest
import torch
from torch import nn

from lorafaas.function_runtime import decode_step as lean
from lorafaas.function_runtime.engine import CACHE_FIELD
from lorafaas.models.lora import attach_adapter, read_host_adapter
from lorafaas.models.reference import load_backbone

pytestmark = pytest.mark.skipif(not lean.SUPPORTED, reason="the lean step needs transformers 5.2x's mask API")


@pytest.fixture
def model(tiny_store, tiny_adapter_dir):
    model, _ = load_backbone(tiny_store.path("tiny-dense"))
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped-query attention
    attach_adapter(model, read_host_adapter(tiny_adapter_dir))
    return model.eval()


def prefill(model, lengths: list[int], seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.stack([torch.cat([torch.zeros(width - n, dtype=torch.long),
                                  torch.randint(1, model.config.vocab_size, (n,), generator=generator)])
                       for n in lengths])
    mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])
    out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    return getattr(out, CACHE_FIELD), mask, out.logits[:, -1].argmax(-1)


def hf_step(model, ids, mask, positions, cache):
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{CACHE_FIELD: cache})
    return out.logits, getattr(out, CACHE_FIELD)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_a_left_padded_batch_decodes_to_hf_logits_and_cache_bit_for_bit(model, dtype) -> None:
    model.to(dtype)
    lengths = [9, 3, 6]
    hf_cache, mask, tokens = prefill(model, lengths)
    lean_cache = copy.deepcopy(hf_cache)
    positions = torch.tensor(lengths)
    for step in range(6):
        mask = torch.cat([mask, torch.ones(len(lengths), 1, dtype=mask.dtype)], dim=1)
        expected, hf_cache = hf_step(model, tokens[:, None], mask, positions[:, None], hf_cache)
        logits = lean.decode_step(model, tokens[:, None], mask, positions[:, None], lean_cache)
        assert logits is not None and logits.dtype == expected.dtype
        assert torch.equal(logits, expected), (step, (logits.float() - expected.float()).abs().max())
        for hf_layer, lean_layer in zip(hf_cache.layers, lean_cache.layers, strict=True):
            assert torch.equal(hf_layer.keys, lean_layer.keys) and torch.equal(hf_layer.values, lean_layer.values)
        tokens, positions = expected[:, -1].argmax(-1), positions + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_an_unpadded_row_decodes_to_hf_logits_bit_for_bit(model, dtype) -> None:
    """No padding: no mask, and HF's grouped-query kernel (enable_gqa), not the packed one of a padded batch."""
    model.to(dtype)
    hf_cache, mask, tokens = prefill(model, [7])
    lean_cache = copy.deepcopy(hf_cache)
    for position in range(7, 11):
        mask = torch.cat([mask, torch.ones(1, 1, dtype=mask.dtype)], dim=1)
        expected, hf_cache = hf_step(model, tokens[:, None], mask, torch.tensor([[position]]), hf_cache)
        assert torch.equal(lean.decode_step(model, tokens[:, None], mask, torch.tensor([[position]]), lean_cache),
                           expected)
        tokens = expected[:, -1].argmax(-1)


def test_a_model_it_cannot_run_is_left_to_hf(model, tiny_store) -> None:
    cache, mask, tokens = prefill(model, [4])
    args = (tokens[:, None], torch.cat([mask, torch.ones(1, 1, dtype=mask.dtype)], dim=1), torch.tensor([[4]]), cache)
    model.model.layers[0].input_layernorm = nn.Sequential(model.model.layers[0].input_layernorm)  # replaced whole
    assert lean.decode_step(model, *args) is None
    moe, _ = load_backbone(tiny_store.path("tiny-moe"))
    assert lean.decode_step(moe, *args) is None
    eager, _ = load_backbone(tiny_store.path("tiny-dense"))
    eager.config._attn_implementation = "eager"
    assert lean.decode_step(eager, *args) is None
