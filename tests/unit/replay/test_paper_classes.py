"""The scheduling issue's first acceptance point on the paper cluster's three workload classes (`sim.paper_table`):
the lorafaas policy's TTFT mean and p99 no worse than ServerlessLLM's, at lower cost. Simulated time: the six runs
take a few seconds and give the same figures every time.

Predictable is the class that needs steadiness (`RateTracker.steady`): its functions share the device holding their
backbone, and without a second instance where compute is spare their overlapping requests halve each other's
prefill (p99 0.807 s against ServerlessLLM's 0.425 s, docs/scheduler.md, "Contention across functions").
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafaas.replay.sim import paper_table
from lorafaas.replay.sim.cluster import load_cluster
from lorafaas.replay.sim.policies import POLICIES
from lorafaas.replay.sim.runner import simulate
from lorafaas.replay.workload import CLASSES


@pytest.mark.parametrize("trace_class", CLASSES)
def test_lorafaas_is_no_slower_than_serverlessllm_at_lower_cost(trace_class: str, tmp_path: Path) -> None:
    work = paper_table.class_workload(trace_class, 8, 240, 1, tmp_path)
    ours = simulate(work, load_cluster("paper"), POLICIES["lorafaas"], 1)[1]
    theirs = simulate(work, load_cluster("paper"), POLICIES["serverlessllm"], 1)[1]
    figures = (f"{trace_class}: lorafaas {ours.summary.ttft_s.mean:.3f} / {ours.summary.ttft_s.p99:.3f} s, "
               f"{ours.cost:.2f} USD; ServerlessLLM {theirs.summary.ttft_s.mean:.3f} / "
               f"{theirs.summary.ttft_s.p99:.3f} s, {theirs.cost:.2f} USD")
    assert ours.summary.num_requests == theirs.summary.num_requests > 1000, figures
    assert ours.summary.ttft_s.mean <= theirs.summary.ttft_s.mean, figures
    assert ours.summary.ttft_s.p99 <= theirs.summary.ttft_s.p99 + 1e-9, figures  # equal: the longest prompts' prefill
    assert ours.cost < theirs.cost, figures


def test_on_off_traffic_is_as_fast_as_with_the_flat_window_at_no_more_cost(tmp_path: Path) -> None:
    """Normal's functions alternate active stretches and pauses (issue 39's third criterion against the
    fixed-keep-alive ablation: mean TTFT within 5%, cost no higher). Their instances kept to the hybrid window through
    every pause, and a steady function's spare started on every idle shared device, cost 14.64 USD against the flat
    window's 13.65 at 0.219 / 0.217 s; stepped retirement in the pauses and spares only beside another function's
    batch bring it under."""
    work = paper_table.class_workload("normal", 8, 240, 1, tmp_path)
    ours = simulate(work, load_cluster("paper"), POLICIES["lorafaas"], 1)[1]
    flat = simulate(work, load_cluster("paper"), POLICIES["fixed-keep-alive"], 1)[1]
    figures = (f"lorafaas {ours.summary.ttft_s.mean:.3f} / {ours.summary.ttft_s.p99:.3f} s, {ours.cost:.2f} USD; "
               f"fixed-keep-alive {flat.summary.ttft_s.mean:.3f} / {flat.summary.ttft_s.p99:.3f} s, "
               f"{flat.cost:.2f} USD")
    assert ours.summary.ttft_s.mean <= 1.05 * flat.summary.ttft_s.mean, figures
    assert ours.cost <= flat.cost, figures


@pytest.mark.parametrize("seed", [2, 4])
def test_bursty_idle_cost_is_bounded_at_every_seed(seed: int, tmp_path: Path) -> None:
    """Keep-alive that pays for itself (issue 39): on the paper's 4-hour histogram range the hybrid window kept a
    burst's last instance for hours, and Bursty at seeds 2 and 4 cost 8.16 and 6.59 USD against ServerlessLLM's 3.56
    and 2.95. The 30-minute range (`SchedulerConfig.histogram_range_s`, chosen on the acceptance matrix across seeds
    1-4) brings them within 1.05x, at a TTFT mean still below ServerlessLLM's."""
    work = paper_table.class_workload("bursty", 8, 240, seed, tmp_path)
    ours = simulate(work, load_cluster("paper"), POLICIES["lorafaas"], seed)[1]
    theirs = simulate(work, load_cluster("paper"), POLICIES["serverlessllm"], seed)[1]
    figures = f"lorafaas {ours.cost:.2f} USD, {ours.summary.ttft_s.mean:.3f} s; ServerlessLLM {theirs.cost:.2f} USD"
    assert ours.cost <= 1.05 * theirs.cost, figures
    assert ours.summary.ttft_s.mean < theirs.summary.ttft_s.mean, figures
