"""The LoRA server's parts in-process: the adapter cache, batched grouping, the expert hook, expert adapter checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lorafaas.errors import AdapterIncompatible, AdapterInvalid, InvalidInput
from lorafaas.formats.adapter_files import CONFIG_FILE
from lorafaas.formats.expert_adapters import (
    ExpertFactors,
    load_expert_layer,
    read_expert_adapter_info,
    write_expert_adapter,
)
from lorafaas.lora_server.cache import AdapterCache
from lorafaas.lora_server.compute import LoraCompute, LoraWork
from lorafaas.models.adapter_validation import validate_expert_adapter
from lorafaas.models.moe_lora import grouped_lora_delta, open_moe_adapter, read_attention_adapter


def _factors(seed: int, experts: int = 4, rank: int = 2, d_in: int = 6, d_out: int = 5) -> ExpertFactors:
    g = torch.Generator().manual_seed(seed)
    return ExpertFactors(
        a=torch.randn(experts, rank, d_in, generator=g), b=torch.randn(experts, d_out, rank, generator=g), scaling=0.5
    )


class _Loader:
    """Real factors per (adapter, layer), counting loads."""

    def __init__(self) -> None:
        self.loads: list[tuple[str, int]] = []

    def __call__(self, adapter_id: str, layer: int) -> dict[str, ExpertFactors]:
        self.loads.append((adapter_id, layer))
        return {"down_proj": _factors(hash((adapter_id, layer)) % 1000)}


def test_the_cache_loads_layer_by_layer_only_what_is_called() -> None:
    loader = _Loader()
    cache = AdapterCache(2, loader)
    assert cache.touch("a") is False
    cache.layer("a", 3)
    assert cache.resident_layers() == {"a": (3,)}
    cache.layer("a", 3)
    cache.layer("a", 0)
    assert loader.loads == [("a", 3), ("a", 0)]
    assert cache.touch("a") is True and cache.num_hits == 1 and cache.num_misses == 1


def test_the_cache_evicts_the_least_frequent_adapter_and_keeps_pinned_ones() -> None:
    cache = AdapterCache(2, _Loader())
    for _ in range(5):
        cache.touch("hot")
    cache.touch("cold")
    cache.touch("new")  # full: "cold" (1 access) goes, "hot" (5) stays
    assert set(cache.resident_layers()) == {"hot", "new"} and cache.num_evictions == 1
    cache.touch("other", pinned={"new"})  # "new" is pinned by the batch: "hot" goes despite its count
    assert set(cache.resident_layers()) == {"new", "other"}


def test_frequency_decays_so_an_adapter_hot_long_ago_is_evicted() -> None:
    cache = AdapterCache(2, _Loader(), half_life_accesses=4)
    for _ in range(10):
        cache.touch("old")
    for _ in range(40):
        cache.touch("recent")
    assert cache.frequency("old") < 1e-2 < cache.frequency("recent")
    cache.touch("third")
    assert set(cache.resident_layers()) == {"recent", "third"}
    with pytest.raises(ValueError, match="capacity"):
        AdapterCache(0, _Loader())


def test_a_batch_of_calls_from_many_instances_equals_each_call_alone() -> None:
    loader = _Loader()
    compute = LoraCompute(AdapterCache(4, loader))
    g = torch.Generator().manual_seed(0)
    calls = [("a", [2, 0, 3, 1]), ("b", [1, 1, 1, 1]), ("a", [0, 4, 0, 2])]
    works = []
    for adapter_id, counts in calls:
        rows = torch.randn(sum(counts), 6, generator=g)
        works.append(
            LoraWork(
                adapter_id=adapter_id,
                layer=1,
                projection="down_proj",
                expert_counts=tuple(counts),
                rows=rows,
                result=torch.empty(sum(counts), 5),
            )
        )
    compute.run(works)
    assert loader.loads == [("a", 1), ("b", 1)]  # each adapter's layer read once for the whole batch
    for work in works:
        expected = grouped_lora_delta(work.rows, list(work.expert_counts), loader(work.adapter_id, 1)["down_proj"])
        torch.testing.assert_close(work.result, expected, atol=1e-6, rtol=1e-5)
    # adapter "a": its two calls share one product per expert they both route to (expert 3) -> 4 + 4 groups
    assert compute.stats.num_groups == 4 + 4 and compute.stats.max_calls_per_batch == 3


def test_an_unloadable_adapter_fails_its_own_calls_only() -> None:
    def loader(adapter_id: str, layer: int):
        if adapter_id == "broken":
            raise OSError("adapter file vanished")
        return {"down_proj": _factors(1)}

    compute = LoraCompute(AdapterCache(4, loader))
    ok = LoraWork(
        adapter_id="ok",
        layer=0,
        projection="down_proj",
        expert_counts=(1, 0, 0, 0),
        rows=torch.ones(1, 6),
        result=torch.empty(1, 5),
    )
    bad = LoraWork(
        adapter_id="broken",
        layer=0,
        projection="down_proj",
        expert_counts=(1, 0, 0, 0),
        rows=torch.ones(1, 6),
        result=torch.empty(1, 5),
    )
    compute.run([bad, ok])
    assert isinstance(bad.error, OSError) and ok.error is None


@pytest.fixture(scope="module")
def expert_adapter(tmp_path_factory: pytest.TempPathFactory, tiny_store) -> Path:
    return write_expert_adapter(
        tmp_path_factory.mktemp("expert") / "a", tiny_store.path("tiny-moe"), seed=3, base_model_name="tiny-moe"
    )


def test_the_attention_part_is_read_as_float32_copies_of_their_own(expert_adapter) -> None:
    """As a dense adapter's factors (`owned_copy`): aligned as PEFT allocates them, so its products round the same."""
    from lorafaas.formats.expert_adapters import read_expert_adapter_info

    attention = read_attention_adapter(read_expert_adapter_info(expert_adapter))
    factors = [f for w in attention.modules.values() for f in (w.a, w.b)]
    assert factors and all(f.dtype == torch.float32 and f.data_ptr() % 64 == 0 for f in factors)
    assert len({f.untyped_storage().data_ptr() for f in factors}) == len(factors)


def test_expert_adapter_validates_against_the_moe_backbone_and_not_the_dense_one(expert_adapter, tiny_store) -> None:
    info = validate_expert_adapter(expert_adapter, tiny_store, "tiny-moe")
    assert info.num_experts == 4 and set(info.projections) == {0, 1}
    assert info.expert_bytes == 2 * 4 * (4 * (64 + 256) + 4 * (128 + 64)) * 4
    factors = load_expert_layer(info, 1)
    assert factors["gate_up_proj"].a.shape == (4, 4, 64) and factors["down_proj"].b.shape == (4, 64, 4)
    with pytest.raises(AdapterIncompatible):
        validate_expert_adapter(expert_adapter, tiny_store, "tiny-dense")


def test_incomplete_expert_sets_and_bad_modes_are_refused(expert_adapter, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    tensors = load_file(expert_adapter / "adapter_model.safetensors")
    del tensors["base_model.model.model.layers.0.mlp.experts.2.down_proj.lora_A.weight"]
    del tensors["base_model.model.model.layers.0.mlp.experts.2.down_proj.lora_B.weight"]
    save_file(tensors, broken / "adapter_model.safetensors")
    (broken / CONFIG_FILE).write_text((expert_adapter / CONFIG_FILE).read_text())
    with pytest.raises(AdapterInvalid, match=r"missing \[2\]"):
        read_expert_adapter_info(broken)
    config = json.loads((expert_adapter / CONFIG_FILE).read_text())
    del config["lorafaas_experts"]
    (broken / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(AdapterInvalid, match="not an expert adapter"):
        read_expert_adapter_info(broken)
    with pytest.raises(InvalidInput, match="no LoRA server"):
        open_moe_adapter(expert_adapter, "remote")
    with pytest.raises(InvalidInput, match="lora mode"):
        open_moe_adapter(expert_adapter, "sideways")  # type: ignore[arg-type]


def test_local_mode_equals_the_backbone_with_the_adapter_merged(expert_adapter, tiny_store) -> None:
    from transformers import AutoModelForCausalLM

    from lorafaas.models.lora import attach_adapter
    from lorafaas.models.moe_lora import install_expert_lora, remove_expert_lora

    model_dir = tiny_store.path("tiny-moe")
    ids = torch.tensor([[1, 5, 7, 9, 11, 13, 40, 50]])
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    merged = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        plain = model(ids).logits
    adapter = open_moe_adapter(expert_adapter, "local")
    install_expert_lora(model, adapter.source, adapter.info)
    attach_adapter(model, adapter.attention)
    with torch.no_grad():
        for layer, path in adapter.info.experts_paths.items():
            for projection, f in load_expert_layer(adapter.info, layer).items():
                getattr(merged.get_submodule(path), projection).add_(torch.einsum("eor,eri->eoi", f.b, f.a) * f.scaling)
        for module, w in adapter.attention.modules.items():
            merged.get_submodule(module).weight.add_((w.b @ w.a) * w.scaling)
        torch.testing.assert_close(model(ids).logits, merged(ids).logits, atol=1e-5, rtol=1e-5)
        remove_expert_lora(model)
        from lorafaas.models.lora import detach_adapter

        detach_adapter(model)
        assert torch.equal(model(ids).logits, plain)
