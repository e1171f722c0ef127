"""The node agent's view for the scheduler (`ArtifactPlanner.profile`) against a real adapter store: a function whose
adapter was just deleted (its function deleted or replaced; the store drops the adapter before the agent drops the
spec) must not make the view fail, since the view is built for other functions' requests too. Found by the random
lifecycle test: another tenant's call got 404 adapter_not_found."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import msgspec

from lorafaas.formats.model_store import ModelStore
from lorafaas.platform.adapter_store import AdapterStore
from lorafaas.platform.agent import AgentConfig
from lorafaas.platform.agent.artifacts import ArtifactPlanner
from lorafaas.platform.agent.function_state import FunctionState
from lorafaas.platform.instance_table import InstanceTable
from lorafaas.platform.state.records import FunctionSpec
from lorafaas.scheduler import Scheduler


def _scheduler(tiny_store: ModelStore, adapters: AdapterStore) -> ArtifactPlanner:
    launcher = SimpleNamespace(store=tiny_store)
    instances = SimpleNamespace(library_import_s=None, daemon_start_s={})
    return ArtifactPlanner(AgentConfig(), InstanceTable(), launcher, Scheduler(), {}, adapters.path,  # type: ignore[arg-type]
                           instances)  # type: ignore[arg-type]


def _spec(digest: str) -> FunctionSpec:
    now = time.time()
    return FunctionSpec(name="f", tenant="t", backbone="tiny-dense", adapter_digest=digest, created_at=now,
                        updated_at=now)


def test_a_function_whose_adapter_was_just_deleted_does_not_fail_the_view(tiny_store: ModelStore,
                                                                         tiny_adapter_dir: Path,
                                                                         tmp_path: Path) -> None:
    adapters = AdapterStore(tmp_path / "adapters")
    digest = adapters.put(tiny_adapter_dir, tiny_store, "tiny-dense")
    scheduler = _scheduler(tiny_store, adapters)
    stored = scheduler.profile(FunctionState(_spec(digest)), with_instance=True)
    assert stored.costs.adapter_device.memory_bytes == adapters.size_bytes(digest) - (
        tiny_adapter_dir / "adapter_config.json").stat().st_size  # the weights' file
    adapters.delete(digest)
    gone = scheduler.profile(FunctionState(_spec(digest)), with_instance=True)  # raised AdapterNotFound before
    assert gone.costs.adapter_device.memory_bytes == 0
    assert gone.costs.backbone_device == stored.costs.backbone_device  # the rest of its profile stands


def test_kv_bytes_per_token_follow_the_backbones_dtype(tiny_store: ModelStore, tmp_path: Path) -> None:
    """A bf16 backbone's KV cache is half a float32 one's (the figure make_room evicts on was 2x too high for bf16)."""
    import json

    from lorafaas.formats.backbone_dtype import convert_backbone

    convert_backbone(tiny_store, "tiny-dense-bf16-kv", "tiny-dense", "bfloat16")
    scheduler = _scheduler(tiny_store, AdapterStore(tmp_path / "adapters"))
    config = json.loads((tiny_store.path("tiny-dense") / "config.json").read_text())
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    per_layer_token = 2 * kv_heads * (config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    float32 = scheduler.kv_bytes_per_token(_spec("x"))
    bf16 = scheduler.kv_bytes_per_token(msgspec.structs.replace(_spec("x"), backbone="tiny-dense-bf16-kv"))
    assert float32 == per_layer_token * config["num_hidden_layers"] * 4
    assert bf16 == float32 // 2
