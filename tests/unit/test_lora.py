"""Unmerged LoRA beside a read-only backbone equals PEFT, and loads fast."""

from pathlib import Path

import pytest
import torch

from lorafaas.errors import AdapterIncompatible
from lorafaas.models.lora import attach_adapter, detach_adapter, read_host_adapter
from lorafaas.models.reference import load_backbone, with_adapter
from lorafaas.testing.tiny_models import TinySpec, save_tiny_adapter, save_tiny_backbone

IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7]])


@pytest.fixture(scope="module")
def backbone(tiny_store):
    return load_backbone(tiny_store.path("tiny-dense"))


def logits(model) -> torch.Tensor:
    with torch.inference_mode():
        return model(IDS).logits


def test_equals_peft_unmerged_bitwise_and_merged_closely(backbone, tiny_store, tiny_adapter_dir: Path) -> None:
    model, _ = backbone
    base = logits(model)
    attach_adapter(model, read_host_adapter(tiny_adapter_dir))
    ours = logits(model)
    detach_adapter(model)
    assert torch.equal(logits(model), base), "detaching must restore the plain backbone"

    peft_model, _ = load_backbone(tiny_store.path("tiny-dense"))
    peft_model = with_adapter(peft_model, tiny_adapter_dir)
    assert not torch.equal(ours, base), "the adapter must change the output"
    assert torch.equal(ours, logits(peft_model))
    merged = peft_model.merge_and_unload()
    rel = (ours - logits(merged)).abs().max() / logits(merged).abs().max()
    assert rel < 1e-4


def test_backbone_weights_are_untouched(backbone, tiny_adapter_dir: Path) -> None:
    model, _ = backbone
    before = {n.replace(".base.", "."): p.detach().clone() for n, p in model.named_parameters()}
    pointers = {n.replace(".base.", "."): p.data_ptr() for n, p in model.named_parameters()}
    attach_adapter(model, read_host_adapter(tiny_adapter_dir))
    after = {n.replace(".base.", "."): p for n, p in model.named_parameters()}
    detach_adapter(model)
    assert set(after) == set(before)
    for name, tensor in before.items():
        assert after[name].data_ptr() == pointers[name]
        assert torch.equal(after[name], tensor)


def test_scaling_follows_alpha_over_rank(tiny_adapter_dir: Path) -> None:
    host = read_host_adapter(tiny_adapter_dir)
    assert {w.scaling for w in host.modules.values()} == {8 / 4}
    assert host.num_bytes == sum(w.a.nbytes + w.b.nbytes for w in host.modules.values())


def test_shape_mismatch_is_refused(backbone, tmp_path: Path) -> None:
    model, _ = backbone
    narrow = save_tiny_backbone(tmp_path / "narrow", spec=TinySpec(hidden_size=32, intermediate_size=64))
    adapter = save_tiny_adapter(tmp_path / "adapter", narrow)
    with pytest.raises(AdapterIncompatible, match="shape mismatch"):
        attach_adapter(model, read_host_adapter(adapter))
    detach_adapter(model)


DEMO_ADAPTERS = sorted(p for p in (Path(__file__).resolve().parents[2] / "examples" / "adapters").iterdir()
                       if (p / "adapter_config.json").is_file())


@pytest.mark.parametrize("adapter_dir", DEMO_ADAPTERS, ids=lambda p: p.name)
def test_factors_are_float32_copies_of_their_own_aligned_as_peft_allocates_them(adapter_dir: Path) -> None:
    """A factor left where `load_file` put it sits at an 8-byte offset of the file's buffer; a float32 GEMM on an
    AVX-512 CPU then rounds differently from PEFT's (64-byte aligned) copy, which turned greedy tokens of a bf16
    reply on an AMD EPYC."""
    adapter = read_host_adapter(adapter_dir)
    storages = set()
    for weights in adapter.modules.values():
        for factor in (weights.a, weights.b):
            assert factor.dtype == torch.float32 and factor.data_ptr() % 64 == 0
            storages.add(factor.untyped_storage().data_ptr())
    assert len(storages) == 2 * len(adapter.modules), "each factor in memory of its own"
