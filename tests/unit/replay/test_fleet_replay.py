"""The fleet workload simulated (`lorafaas replay fleet`, issue 41): a small fleet on the paper cluster reports the
figures of acceptance 4 per policy (plan time, TTFT p99, cost; rank-aware and rank-blind against ServerlessLLM), and
keeps idle instances within each node's budget."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from lorafaas.cli import app, main
from lorafaas.replay.fleet import FleetOptions, fleet_cluster, fleet_workload
from lorafaas.replay.sim.cluster import load_cluster
from lorafaas.replay.sim.engine import Simulator
from lorafaas.replay.sim.policies import POLICIES
from lorafaas.scheduler import FunctionName


def test_the_fleet_replay_runs_200_functions_and_reports_plan_time_ttft_and_cost() -> None:
    result = CliRunner().invoke(app, ["replay", "fleet", "--functions", "200", "--rate", "4", "--duration", "60",
                                      "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.output)
    rows = {row["policy"]: row for row in document["policies"]}
    assert set(rows) == {"lorafaas", "lorafaas-rank-blind", "serverlessllm"}
    requests = len(fleet_workload(FleetOptions(functions=200, rate_per_s=4, duration_s=60)).requests)
    for name, row in rows.items():
        assert row["requests"] == requests > 100 and row["failed"] == 0, row
        assert row["ttft_p99_s"] > 0 and row["cost"] > 0, row
        if name == "serverlessllm":
            assert row["plans"] == 0 and row["plan_p50_ms"] is None
        else:  # the scheduler planned for the whole fleet, called or not, and its time is reported
            assert row["plans"] >= 2 and 0 < row["plan_p50_ms"] <= row["plan_max_ms"], row


def test_the_fleet_mixes_adapter_shapes_and_the_rank_blind_scheduler_sees_them_alike() -> None:
    options = FleetOptions(functions=60, rate_per_s=2, duration_s=30)
    cluster = fleet_cluster(load_cluster("paper"), options)
    sizes = {spec.adapter_bytes for spec in cluster.functions.values()}
    assert min(sizes) < 10e6 < 200e6 < max(sizes)  # rank 4 on q/v against rank 64 on every linear layer
    assert len({spec.step_factor for spec in cluster.functions.values()}) > 5
    workload = fleet_workload(options)
    assert len(workload.functions) == 60  # the never-called tail is deployed too
    aware = Simulator(cluster, POLICIES["lorafaas"], workload)
    blind = Simulator(cluster, POLICIES["lorafaas-rank-blind"], workload)
    for backbone in cluster.backbones:  # one price per backbone: the reference shape on its widths
        priced = {(c.memory_bytes, c.load_s) for name, spec in cluster.functions.items() if spec.backbone == backbone
                  and (c := blind.views.profiles[FunctionName(name)].costs.adapter_device) is not None}
        assert len(priced) == 1, (backbone, priced)
    own = {aware.views.profiles[FunctionName(n)].costs.adapter_device.memory_bytes  # type: ignore[union-attr]
           for n in cluster.functions}
    assert own == sizes


def test_idle_instances_stay_within_each_nodes_budget() -> None:
    options = FleetOptions(functions=150, rate_per_s=6, duration_s=90)
    cluster = fleet_cluster(load_cluster("paper"), options)
    budget = 12 * 10**9
    simulator = Simulator(cluster.__class__(**{**cluster.__dict__, "idle_budget_bytes": budget}),
                          POLICIES["lorafaas"], fleet_workload(options))
    checked = []
    keep = simulator.lifecycle.keep_within_budget

    def checked_keep(node: int) -> None:
        keep(node)
        idle = [i for d in simulator.mem.devices if d.node == node for i in d.instances
                if not i.running and not i.num_seqs and i.ready_at_s <= simulator.now]
        checked.append(sum(simulator.lifecycle.idle_instance(i).private_bytes for i in idle))

    simulator.lifecycle.keep_within_budget = checked_keep  # type: ignore[method-assign]
    outcome = simulator.run()
    assert outcome.budget_retirements > 0 and all(r.ok for r in outcome.results)
    assert checked and max(checked) <= budget


def test_bad_fleet_options_are_refused_with_the_value(capsys) -> None:
    result = CliRunner().invoke(app, ["replay", "fleet", "--functions", "0"])
    assert result.exit_code != 0 and "--functions" in result.output
    with pytest.raises(SystemExit) as exited:  # the CLI's entry point: a message and a non-zero exit, no traceback
        main(["replay", "fleet", "--functions", "5", "--cluster", "local"])
    assert exited.value.code != 0
    assert "backbone 'smollm2-135m' has no widths" in capsys.readouterr().err


def test_the_simulated_fleet_is_the_benchmarks_fleet() -> None:
    """`replay fleet` and `bench fleet` simulate and drive one workload: for a seed, the same adapters (rank, target
    modules) behind the same names, and the same arrivals to the same functions at the same offsets."""
    from lorafaas.replay.fleet import fleet_shapes
    from lorafaas.testing.fleet_workload import WorkloadSpec, arrivals, fleet_plan

    options = FleetOptions(functions=300, rate_per_s=5, duration_s=30, seed=7)
    plan = fleet_plan(300, seed=7)
    assert [(s.rank, tuple(s.target_modules)) for s in fleet_shapes(options)] == [(a.rank, a.target_modules)
                                                                                   for a in plan]
    bench = arrivals(WorkloadSpec(functions=300, rate_per_s=5, duration_s=30, seed=7))
    simulated = fleet_workload(options).requests
    assert [(r.arrival_s, r.function) for r in simulated] == [(a.at_s, plan[a.function].name) for a in bench]
