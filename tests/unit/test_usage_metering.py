"""Metering (platform/metering.py) and usage recording (platform/usage.py) without processes: the device share of
overlapping requests, the summaries and time bounds of GET /v1/usage, and a store failure counted, never raised."""

import asyncio
import logging
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from lorafaas.errors import InvalidInput
from lorafaas.platform.gateway.metrics import UsageCollector
from lorafaas.platform.instance_table import Identity, Instance
from lorafaas.platform.metering import DeviceShareClock, UsageMeter
from lorafaas.platform.state.records import FunctionSpec
from lorafaas.platform.state.sqlite import SQLiteStore
from lorafaas.platform.usage import UsageRecorder, parse_time, report_line, summarize, usage_record

SPEC = FunctionSpec(name="sea", tenant="acme", backbone="tiny-dense", adapter_digest="a" * 64, uid="d1",
                    created_at=1.0, updated_at=1.0)
TOKENS = {"prompt_tokens": 7, "completion_tokens": 3}  # what the node agent saw of an invocation


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_overlapping_requests_share_the_device_and_their_shares_add_up_to_its_busy_time() -> None:
    clock = FakeClock()
    device = DeviceShareClock(clock)
    a = device.enter()  # t=0: a alone for 2 s
    clock.now = 2.0
    b = device.enter()  # t=2..4: a and b together
    clock.now = 4.0
    share_a = device.leave(a)
    clock.now = 5.0  # b alone for 1 s
    share_b = device.leave(b)
    clock.now = 9.0  # idle: nobody is charged
    c = device.enter()
    clock.now = 10.0
    share_c = device.leave(c)
    assert (share_a, share_b, share_c) == (3.0, 2.0, 1.0)
    assert share_a + share_b + share_c == 6.0  # busy 0..5 and 9..10, not the 10 s of wall time


def test_a_record_charges_memory_for_the_device_share_and_the_keep_alive_before_it() -> None:
    meter = UsageMeter(arrived_s=10.0, dispatched_s=10.5, first_event_s=11.0, finished_s=12.0, instance_id="i1",
                       cold_start="libraries_preloaded", cold_start_s={"spawn": 0.25, "backbone": 0.125},
                       device_s=1.5, active_bytes=2 * 10**9, keep_alive_s=4.0, idle_bytes=0.5 * 10**9, **TOKENS)
    record = usage_record(SPEC, "r1", meter, now=1000.0)
    assert (record.queue_s, record.ttft_s, record.e2e_s) == (0.5, 1.0, 2.0)
    assert (record.memory_active_gb_s, record.memory_idle_gb_s, record.memory_gb_s) == (3.0, 2.0, 5.0)
    assert report_line(record) == (
        "REPORT RequestId: r1  Duration: 2000.00 ms  Queue: 500.00 ms  TTFT: 1000.00 ms  Prompt tokens: 7  "
        "Completion tokens: 3  Cold start: libraries_preloaded (spawn 250 ms, backbone 125 ms)  "
        "Device-seconds: 1.500000  Memory: 5.000000 GB-s")


def test_summaries_group_by_function_or_tenant() -> None:
    other = FunctionSpec(name="sky", tenant="globex", backbone="tiny-dense", adapter_digest="a" * 64, uid="d2",
                         created_at=1.0, updated_at=1.0)
    records = [usage_record(spec, f"r{i}", UsageMeter(device_s=0.5, **TOKENS), now=float(i))
               for i, spec in enumerate([SPEC, SPEC, other])]
    by_function = summarize(records, "function")
    assert [(g["tenant"], g["function"], g["invocations"], g["prompt_tokens"], g["device_s"])
            for g in by_function["groups"]] == [("acme", "sea", 2, 14, 1.0), ("globex", "sky", 1, 7, 0.5)]
    assert by_function["total"]["completion_tokens"] == 9 and by_function["total"]["cold_starts"] == 0
    assert [g["tenant"] for g in summarize(records, "tenant")["groups"]] == ["acme", "globex"]
    with pytest.raises(InvalidInput, match="group_by"):
        summarize(records, "color")


@pytest.mark.parametrize(("value", "seconds"), [("1732435200", 1732435200.0), ("1732435200.5", 1732435200.5),
                                                 ("2024-11-24T08:00:00Z", 1732435200.0),
                                                 ("2024-11-24T08:00:00", 1732435200.0),
                                                 ("2024-11-24T09:00:00+01:00", 1732435200.0), ("-1", -1.0),
                                                 (None, None)])
def test_time_bounds_are_unix_seconds_or_iso_8601(value, seconds) -> None:
    assert parse_time("since", value) == seconds


@pytest.mark.parametrize("value", ["yesterday", "nan", "inf", "2024-13-01"])
def test_a_bad_time_bound_names_its_field(value) -> None:
    with pytest.raises(InvalidInput, match=r"^until is"):
        parse_time("until", value)


def test_an_idle_instance_that_stops_charges_its_last_keep_alive_to_its_function(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "state.db")
    recorder = UsageRecorder(store, log_dir=None)
    instance = Instance("i7", Identity.of(SPEC), "cpu")

    async def stop_one() -> None:
        recorder.record(SPEC, "r1", UsageMeter(device_s=0.5, active_bytes=10**9, **TOKENS))
        recorder.record_keep_alive(instance, idle_s=30.0, idle_bytes=0.25 * 10**9)
        await recorder.flush()

    asyncio.run(stop_one())
    records = store.list_usage()
    assert sorted(r.kind for r in records) == ["invocation", "keep_alive"]
    [group] = summarize(records, "function")["groups"]
    assert (group["invocations"], group["keep_alive_s"], group["memory_idle_gb_s"]) == (1, 30.0, 7.5)
    assert group["memory_gb_s"] == 8.0 and group["device_s"] == 0.5
    store.close()


def test_a_store_that_fails_costs_the_invocation_nothing_and_is_counted_in_metrics(tmp_path: Path, caplog) -> None:
    store = SQLiteStore(tmp_path / "state.db")
    store.close()  # every call now raises StoreUnavailable
    recorder = UsageRecorder(store, log_dir=None)

    async def finish_one() -> None:
        recorder.record(SPEC, "r1", UsageMeter(device_s=0.1, **TOKENS))  # returns at once, raises nothing
        await recorder.flush()

    with caplog.at_level(logging.WARNING, logger="lorafaas.platform.usage"):
        asyncio.run(finish_one())
    assert recorder.num_failures == 1
    assert "usage of invocation r1 was not recorded" in caplog.text
    registry = CollectorRegistry()
    registry.register(UsageCollector(recorder))
    assert "lorafaas_usage_record_failures_total 1.0" in generate_latest(registry).decode()
