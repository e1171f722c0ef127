"""The node agent's view for the scheduler (`ArtifactPlanner.view`) against a real adapter store and model store.

The artifacts' sizes come from the agent's catalogue, read when a function is applied: building the view (every plan
tick, every offload decision) reads no adapter file. So a function whose adapter was just deleted (its function
deleted or replaced; the store drops the adapter before the agent drops the spec) cannot make the view fail (found by
the random lifecycle test: another tenant's call got 404 adapter_not_found), a redeploy of another adapter updates the
size, and a removed function leaves nothing of it behind.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from lorafaas.formats.model_store import ModelStore
from lorafaas.platform.adapter_store import AdapterStore
from lorafaas.platform.agent import AgentConfig, NodeAgent
from lorafaas.platform.agent.artifacts import DEFAULT_LOAD_S, ArtifactPlanner
from lorafaas.platform.agent.catalogue import ArtifactCatalogue
from lorafaas.platform.instance_table import InstanceTable
from lorafaas.platform.state.records import FunctionSpec
from lorafaas.scheduler import FunctionName, Scheduler, SchedulerConfig
from lorafaas.testing.tiny_models import save_tiny_adapter
from tests.support.store_only_launcher import StoreOnlyLauncher


def _spec(digest: str, version: int = 1) -> FunctionSpec:
    now = time.time()
    return FunctionSpec(name="f", tenant="t", backbone="tiny-dense", adapter_digest=digest, version=version,
                        created_at=now, updated_at=now)


def _weights_bytes(adapters: AdapterStore, digest: str) -> int:
    return (adapters.path(digest) / "adapter_model.safetensors").stat().st_size


@pytest.fixture
def adapters(tmp_path: Path) -> AdapterStore:
    return AdapterStore(tmp_path / "adapters")


def _agent(tiny_store: ModelStore, adapters: AdapterStore) -> NodeAgent:
    config = AgentConfig(scheduler=SchedulerConfig(preloading=False))
    return NodeAgent(StoreOnlyLauncher(tiny_store), adapters.path, config)  # type: ignore[arg-type]


def _adapter_in_view(agent: NodeAgent) -> int | None:
    costs = agent.planner.profile(agent.functions["f"], with_instance=True).costs
    assert costs.adapter_device is not None
    return costs.adapter_device.memory_bytes


def test_the_view_reads_no_adapter_file_and_follows_redeploys_and_removal(tiny_store: ModelStore,
                                                                         tiny_adapter_dir: Path, tmp_path: Path,
                                                                         adapters: AdapterStore) -> None:
    first = adapters.put(tiny_adapter_dir, tiny_store, "tiny-dense")
    bigger_dir = save_tiny_adapter(tmp_path / "rank8", tiny_store.path("tiny-dense"), rank=8,
                                   base_model_name="tiny-dense")
    second = adapters.put(bigger_dir, tiny_store, "tiny-dense")
    first_bytes, second_bytes = _weights_bytes(adapters, first), _weights_bytes(adapters, second)
    assert first_bytes != second_bytes
    agent = _agent(tiny_store, adapters)

    async def scenario() -> None:
        agent.apply(_spec(first))
        adapters.delete(first)  # after apply: the view must not need the file (it reported 0 bytes before)
        assert _adapter_in_view(agent) == first_bytes
        assert FunctionName("f") in agent.planner.view().functions  # and building it raises nothing
        agent.apply(_spec(second, version=2))  # a new adapter under the same deployment: its size is read again
        assert agent.functions["f"].adapter_bytes == second_bytes
        assert _adapter_in_view(agent) == second_bytes
        assert agent.catalogue.known_backbones() == {"tiny-dense"}
        await agent.remove("f")
        assert "f" not in agent.functions and agent.planner.view().functions == {}
        assert agent.catalogue.known_backbones() == frozenset()  # nothing of it is kept
        await agent.stop()

    asyncio.run(scenario())


def test_an_adapter_already_gone_when_applied_counts_as_zero(tiny_store: ModelStore, adapters: AdapterStore) -> None:
    agent = _agent(tiny_store, adapters)

    async def scenario() -> None:
        agent.apply(_spec("0" * 64))  # deleted or replaced before the agent saw it: never another request's error
        assert _adapter_in_view(agent) == 0
        assert agent.planner.view().functions[FunctionName("f")].costs.backbone_device.memory_bytes == \
            tiny_store.get("tiny-dense").bytes  # the rest of its profile stands
        await agent.stop()

    asyncio.run(scenario())


def test_kv_bytes_per_token_follow_the_backbones_dtype(tiny_store: ModelStore, adapters: AdapterStore) -> None:
    """A bf16 backbone's KV cache is half a float32 one's (the figure make_room evicts on was 2x too high for bf16)."""
    from lorafaas.formats.backbone_dtype import convert_backbone

    convert_backbone(tiny_store, "tiny-dense-bf16-kv", "tiny-dense", "bfloat16")
    instances = SimpleNamespace(library_import_s=None, daemon_start_s={})
    planner = ArtifactPlanner(AgentConfig(), InstanceTable(), SimpleNamespace(store=tiny_store),  # type: ignore[arg-type]
                              Scheduler(), {}, ArtifactCatalogue(lambda: tiny_store, adapters.path),
                              instances)  # type: ignore[arg-type]
    config = json.loads((tiny_store.path("tiny-dense") / "config.json").read_text())
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    per_layer_token = 2 * kv_heads * (config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    float32 = planner.kv_bytes_per_token(_spec("x"))
    bf16 = planner.kv_bytes_per_token(msgspec.structs.replace(_spec("x"), backbone="tiny-dense-bf16-kv"))
    assert float32 == per_layer_token * config["num_hidden_layers"] * 4
    assert bf16 == float32 // 2


def test_an_idle_functions_view_is_made_again_when_what_it_reads_changes(tiny_store: ModelStore,
                                                                        adapters: AdapterStore) -> None:
    """A function without a ready instance keeps its part of the view between views (a fleet's thousand are most of
    a view's cost), but never a stale one: a measured load, a changed spec and a removal each show at once."""
    agent = _agent(tiny_store, adapters)

    def backbone_load_s() -> float:
        return agent.planner.view().functions[FunctionName("f")].costs.backbone_device.load_s

    async def scenario() -> None:
        agent.apply(_spec("0" * 64))
        before = backbone_load_s()
        assert agent.planner.view().functions[FunctionName("f")] is agent.planner.view().functions[FunctionName("f")]
        agent.functions["f"].load_s["backbone"] = 7.0  # a start measured it
        assert backbone_load_s() == pytest.approx(before - DEFAULT_LOAD_S["backbone"] + 7.0)
        agent.apply(msgspec.structs.replace(_spec("0" * 64, version=2), slo_ttft_ms=123))
        assert agent.planner.view().functions[FunctionName("f")].slo_ttft_s == pytest.approx(0.123)
        await agent.remove("f")
        assert agent.planner.view().functions == {} and agent.planner._idle_cache == {}
        await agent.stop()

    asyncio.run(scenario())
