"""`describe` is typed end to end (issue 37): the agent's failure records, the backend's pod failures, an
instance's adapter stats and offloads are structs, and encode to the JSON `describe` always answered (HTTP body and
`lorafaas describe --json`): the same keys in the same order, null where null, absent where absent."""

from __future__ import annotations

import json

import msgspec

from lorafaas.function_runtime.messages import AdapterStats
from lorafaas.platform.agent.function_state import FailureRecord, OffloadEvent
from lorafaas.platform.backends.pod_status import PodFailure
from lorafaas.platform.descriptions import (
    AdmissionView,
    BatchingView,
    FailureView,
    FunctionDescription,
    InstanceView,
)
from lorafaas.platform.instance_table import Identity, Instance
from lorafaas.platform.metering import adapter_bytes
from lorafaas.platform.state.records import FunctionSpec

SPEC = FunctionSpec(name="f", tenant="t", backbone="b", adapter_digest="d" * 64, created_at=1.0,
                    updated_at=1.0)


def encoded(value: msgspec.Struct) -> dict:
    return json.loads(msgspec.json.encode(value))


def test_an_agent_failure_keeps_its_fields_and_a_pod_failure_its_own() -> None:
    agent = FailureRecord("f-1", None, "exited unexpectedly", 2, 1.5).describe()
    pod = PodFailure("f", "f-2", "f-2-pod", "OOMKilled", "out of memory", None, 2.5).describe()
    assert isinstance(agent, FailureView) and isinstance(pod, FailureView)
    assert list(encoded(agent).items()) == [("instance_id", "f-1"), ("pid", None), ("reason", "exited unexpectedly"),
                                            ("version", 2), ("at", 1.5)]
    assert list(encoded(pod).items()) == [("instance_id", "f-2"), ("pod", "f-2-pod"), ("reason", "OOMKilled"),
                                          ("message", "out of memory"), ("exit_code", None), ("at", 2.5)]


def test_an_instance_shows_its_adapter_stats_and_a_reason_only_when_it_has_one() -> None:
    spec = SPEC
    instance = Instance("f-1", Identity.of(spec), "cpu", state="ready", started_at=3.0, cold_start={"total": 0.5},
                        loaded={"adapter", "backbone"})
    assert isinstance(instance.describe(), InstanceView)
    assert encoded(instance.describe())["adapter"] is None and "reason" not in encoded(instance.describe())
    instance.adapter = AdapterStats(kind="experts", lora_mode="remote", held_bytes=10, expert_bytes=20)
    instance.reason = "draining"
    shown = encoded(instance.describe())
    assert list(shown["adapter"].items()) == [("kind", "experts"), ("lora_mode", "remote"), ("held_bytes", 10),
                                              ("expert_bytes", 20)]
    assert shown["reason"] == "draining" and shown["loaded"] == ["adapter", "backbone"]
    assert adapter_bytes(instance) == 10  # what metering charges is the typed figure
    instance.adapter = AdapterStats(kind="dense", held_bytes=7)
    assert encoded(instance.describe())["adapter"] == {"kind": "dense", "lora_mode": None, "held_bytes": 7,
                                                       "expert_bytes": 0}


def test_a_description_decodes_as_the_client_reads_it_into_the_same_json() -> None:
    spec = SPEC
    description = FunctionDescription(
        function=spec, instances=[], last_cold_start={"total": 0.25}, cold_starts={"scale_out": 1},
        offloaded=[OffloadEvent("adapter", "device", None, 4.0, "make room").describe()],
        batching=BatchingView(max_batch_size=4, prefill_t0_s=0.1, prefill_per_request_s=0.01, prefills_observed=3,
                              most_in_flight=2),
        admission=AdmissionView(queued=0, last_decision=None, reason=None, waits={}),
        failures=[FailureRecord("f-1", 41, "hung for 30 s", 1, 1.0).describe(),
                  PodFailure("f", "f-2", "f-2-pod", "Evicted", "node pressure", 137, 2.0).describe()])
    body = msgspec.json.encode(description)
    assert json.loads(body)["offloaded"] == [{"kind": "adapter", "from": "device", "to": "dropped", "at": 4.0,
                                              "reason": "make room"}]
    decoded = msgspec.json.decode(body, type=FunctionDescription)
    assert decoded == description and msgspec.json.encode(decoded) == body
    assert [set(f) for f in json.loads(body)["failures"]] == [{"instance_id", "pid", "reason", "version", "at"},
                                                              {"instance_id", "pod", "reason", "message", "exit_code",
                                                               "at"}]
