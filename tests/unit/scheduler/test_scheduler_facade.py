"""The `Scheduler` a node agent drives, its configuration, and the package's purity."""

from __future__ import annotations

import ast
import json
import random
from pathlib import Path

import pytest
from scheduler_builders import fn, res, view
from typer.testing import CliRunner

import lorafaas.scheduler
from lorafaas.scheduler import Scheduler, SchedulerConfig


def test_plan_uses_online_rates() -> None:
    scheduler = Scheduler(SchedulerConfig(), random.Random(0))
    # a is busy (estimated from arrivals), b's profile says 5/s but it was never seen: b keeps its rate
    for k in range(40):
        scheduler.observe_arrival("a", 0.25 * k)
    for size, seconds in ((1, 0.10), (5, 0.18)):
        scheduler.observe_prefill("a", 0.5, size, seconds)
    v = view([fn("a", slo_s=0.5, warmup=None), fn("b", rate=5.0, slo_s=0.3, warmup=None)],
             devices=[("d0", 100, 0)], slots=[("s0", 100, 0, None), ("s1", 100, 0, None)])
    plan = scheduler.plan(v, now_s=10.0)
    assert {p.function for p in plan.preloads} == {"a", "b"}
    assert not scheduler.should_replan(10.0)
    for k in range(200):
        scheduler.observe_arrival("a", 10.0 + 0.02 * k)  # 50/s now
    assert scheduler.should_replan(14.0)


def test_a_function_never_invoked_is_staged_only_above_a_zero_floor() -> None:
    v = view([fn("new", rate=0.0, warmup=None)], devices=[("d0", 100, 0)], slots=[("s0", 100, 0, None)])
    staged = Scheduler(SchedulerConfig(), random.Random(0)).plan(v, now_s=0.0)
    assert {(p.function, p.kind) for p in staged.preloads} >= {("new", "libraries"), ("new", "backbone")}
    without_floor = Scheduler(SchedulerConfig(rate_floor_per_s=0.0), random.Random(0))
    just_deployed = without_floor.plan(v, now_s=0.0)  # expected within the device horizon of its deploy
    assert {(p.function, p.kind) for p in just_deployed.preloads} >= {("new", "libraries"), ("new", "backbone")}
    assert without_floor.plan(v, now_s=600.0).preloads == ()  # not invoked by then, and no floor: nothing


def test_decisions_route_to_the_policies() -> None:
    scheduler = Scheduler(SchedulerConfig(fixed_keep_alive_s=42))
    decision = scheduler.decide_batch("f", 0.5, queue_len=1, oldest_wait_s=0.0, now_s=0.0)
    assert not decision.dispatch
    policy = scheduler.batch_policy("f", 0.5)
    scheduler.observe_prefill("f", 0.8, 1, 0.1)  # the SLO changed: same fitted model, new B
    assert scheduler.batch_policy("f", 0.8).model is policy.model
    loaded = view([fn("f")], devices=[("d0", 12, 0)], resident=[res("f", "backbone", "device", "d0"),
                                                               res("f", "adapter", "device", "d0")])
    assert scheduler.make_room(loaded, "d0", 2).satisfied
    assert scheduler.place("f", loaded).kind == "backbone"
    assert scheduler.keep_alive("f").keep_alive_s == 42
    for _ in range(20):
        scheduler.observe_idle("f", 61.0)
    assert scheduler.keep_alive("f").reason == "histogram"
    scheduler.forget("f")
    assert scheduler.keep_alive("f").reason == "fixed:few_samples"


@pytest.mark.parametrize(("field", "value", "message"), [
    ("max_batch_size", 0, "max_batch_size"),
    ("rate_window_s", 0.0, "rate_window_s"),
    ("prefill_fit_decay", 1.5, "prefill_fit_decay"),
    ("keep_alive_policy", "arima", "'fixed' or 'hybrid'"),
    ("placement_top_k", 0, "placement_top_k"),
    ("head_percentile", 99.5, "percentiles"),
    ("histogram_range_s", 30.0, "shorter than one bin"),
    ("prewarm_margin", 2.0, "prewarm_margin"),
    ("steady_min_gaps", -1, "steady_min_gaps"),
    ("steady_max_gaps", 1, "steady_max_gaps"),
])
def test_config_bounds_name_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**{field: value})


# numpy: array math without I/O (the MoE provisioning model's Poisson tables and DP); torch stays out.
ALLOWED = {"__future__", "bisect", "heapq", "math", "random", "dataclasses", "typing", "collections",
           "collections.abc", "numpy"}


def test_the_scheduler_package_stays_pure() -> None:
    """Only the standard library's data and math modules, numpy and the package itself: no I/O, clocks, torch,
    platform."""
    package = Path(lorafaas.scheduler.__file__).parent
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert name in ALLOWED or name.startswith("lorafaas.scheduler"), f"{path.name} imports {name}"


def test_bench_scheduler_command_prints_the_four_figures() -> None:
    from lorafaas.cli import app

    result = CliRunner().invoke(app, ["bench", "scheduler", "--json", "--repeats", "1"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)
    assert set(figures) == {"preload_plan_ms_100x8", "preload_plan_ms_1000x16", "batch_decision_us",
                            "offload_decision_ms"}
    assert all(value > 0 for value in figures.values())


def test_on_a_cpu_the_horizon_and_steadiness_are_off_and_on_a_gpu_kept() -> None:
    from lorafaas.scheduler import for_device_kind

    config = SchedulerConfig()
    cpu = for_device_kind(config, "cpu")
    assert (cpu.device_preload_horizon_s, cpu.steady_min_gaps) == (0.0, 0)  # one device: nowhere else to go
    assert for_device_kind(config, "gpu") == config
