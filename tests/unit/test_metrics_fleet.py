"""/metrics at a thousand functions: a bounded number of series per function and the whole scrape under 2 MB
(docs/platform.md, "Metrics at a thousand functions"); its render time is `lorafaas bench control-plane`'s.

Every function here has been invoked (succeeded and rejected), cold-started and has a ready instance: the most series
a function can have at once but for failures, which are bounded by their reasons."""

from __future__ import annotations

import subprocess
import time

from prometheus_client import generate_latest

from lorafaas.formats.model_store import ModelStore
from lorafaas.platform.agent import AgentConfig, NodeAgent
from lorafaas.platform.agent.function_state import FunctionState
from lorafaas.platform.gateway.metrics import GatewayMetrics, InstancePss
from lorafaas.platform.instance_table import Identity, Instance
from lorafaas.platform.state.records import FunctionSpec
from lorafaas.scheduler import SchedulerConfig
from tests.support.store_only_launcher import StoreOnlyLauncher

NUM_FUNCTIONS = 1000
MAX_SERIES_PER_FUNCTION = 8  # 2 invocation outcomes, 2 + 2 latency summaries, 1 cold-start kind, 1 live state
MAX_SCRAPE_BYTES = 2 * 1024**2



def _fleet_metrics(tiny_store: ModelStore) -> GatewayMetrics:
    agent = NodeAgent(StoreOnlyLauncher(tiny_store), lambda digest: tiny_store.models_dir,  # type: ignore[arg-type]
                      AgentConfig(scheduler=SchedulerConfig(preloading=False)))
    metrics = GatewayMetrics(agent)
    now = time.time()
    for index in range(NUM_FUNCTIONS):
        name = f"customer-function-{index:04d}"
        spec = FunctionSpec(name=name, tenant="acme", backbone="tiny-dense", adapter_digest=f"{index:064x}",
                            created_at=now, updated_at=now)
        state = FunctionState(spec, 4096)
        state.cold_starts["libraries_preloaded"] = 1
        agent.functions[name] = state
        instance = agent.table.add(Instance(f"i-{index}", Identity.of(spec), "cpu", "tiny-dense"))
        agent.table.transition(instance, "ready")
        metrics.observe(name, "succeeded", ttft_s=0.2 + index / 1e4, e2e_s=1.0, completion_tokens=16)
        metrics.observe(name, "rejected")
    return metrics


def test_a_thousand_functions_scrape_under_2_mb_with_bounded_series_each(tiny_store: ModelStore) -> None:
    body = generate_latest(_fleet_metrics(tiny_store).registry).decode()
    samples = [line for line in body.splitlines() if line and not line.startswith("#")]
    per_function = [line for line in samples if 'function="customer-function-0417"' in line]
    assert len(per_function) == MAX_SERIES_PER_FUNCTION, per_function
    named = {line.split('function="', 1)[1].split('"', 1)[0] for line in samples if 'function="' in line}
    assert len(named) == NUM_FUNCTIONS  # every function is there: nothing refused or dropped
    assert len(body.encode()) < MAX_SCRAPE_BYTES, len(body.encode())
    assert not [line for line in samples if "_created" in line]
    fleet = [line for line in samples if line.startswith("lorafaas_fleet_ttft_seconds_count")]
    assert fleet == [f"lorafaas_fleet_ttft_seconds_count {float(NUM_FUNCTIONS)}"]


def test_a_scrape_reads_the_memory_of_a_few_instances_and_keeps_the_others_last_figure() -> None:
    """Reading an instance's PSS takes ~10 ms: a scrape reads at most 4, those read longest ago, each at most every
    10 s, so a thousand warm instances do not make each scrape take seconds; every instance is counted within a few
    scrapes, an exited one no more."""
    processes = [subprocess.Popen(["sleep", "60"]) for _ in range(6)]
    now = [0.0]
    try:
        live = {process.pid: "cpu" for process in processes}
        pss = InstancePss(max_reads_per_scrape=4, max_age_s=10.0, clock=lambda: now[0])
        first = pss.per_device(live)["cpu"]
        second = pss.per_device(live)["cpu"]  # the two not read yet join
        assert 0 < first < second
        assert second / 6 * 3 < first < second / 6 * 5  # four of six alike processes
        assert pss.per_device(live)["cpu"] == second  # nothing is due again before 10 s
        processes[0].kill()
        processes[0].wait()
        del live[processes[0].pid]
        assert pss.per_device(live)["cpu"] < second
    finally:
        for process in processes:
            process.kill()
            process.wait()
