"""The simulator's worker model against the lorafaas worker and node agent: requests waiting for a worker are
prefilled in one padded pass, decoding goes at the rate the device's load allows as it changes, and a request joins a
running batch when every instance holds B and none can start."""

from dataclasses import replace
from importlib import resources

import pytest
import yaml

from lorafaas.errors import ClusterInvalid
from lorafaas.replay.sim.cluster import load_cluster, parse_cluster
from lorafaas.replay.sim.costmodel import CostModel
from lorafaas.replay.sim.policies import POLICIES
from lorafaas.replay.sim.runner import simulate
from lorafaas.replay.workload import Request, Workload

# the worker's mechanics at one thread: an instance alone here runs as it would beside others (the step gate's
# lone speedup is test_simulator.py's)
LOCAL = replace(load_cluster("local"), lone_speedup=1.0)
COSTS = CostModel(LOCAL)
SMOL = LOCAL.backbones["smollm2-135m"]


def _work(*items: tuple[float, str, int, int]) -> Workload:
    reqs = tuple(Request(t, "t", fn, p, o) for t, fn, p, o in items)
    return Workload(reqs, max(r.arrival_s for r in reqs) + 1)


def _step(rows: int) -> float:
    return COSTS.decode_step_s(SMOL, rows)


def test_requests_waiting_for_a_worker_share_one_padded_pass() -> None:
    # pirate warm from its first request; two arrive at once at 30 s (one pass, padded to 40 tokens), a third during
    # that pass waits for it and for the one decode step of the two before the next pass
    work = _work((0.0, "pirate", 10, 2), (30.0, "pirate", 10, 2), (30.0, "pirate", 40, 2), (30.1, "pirate", 10, 2))
    out, _ = simulate(work, LOCAL, POLICIES["fixed-keep-alive"])
    first, second, third = out.results[1:]
    together = COSTS.prefill_pass_s(SMOL, [10, 40])
    assert together == pytest.approx(SMOL.prefill_base_s + SMOL.prefill_s_per_token * 2 * 40)
    assert first.ttft_s == second.ttft_s == pytest.approx(together + LOCAL.request_overhead_s)
    alone = COSTS.prefill_pass_s(SMOL, [10])
    assert third.ttft_s == pytest.approx(30.0 + together + _step(2) + alone + LOCAL.request_overhead_s - 30.1)
    assert out.num_cold_starts == 1


def test_decoding_slows_while_another_instance_of_the_device_runs() -> None:
    # pirate decodes 40 steps from 30 s; haiku (warm) runs one short request from 31 s: two busy one-thread
    # instances on two cores step 1 + core_interference times slower, only while both run (this machine calibrates
    # to 0 today; 2026-11-24's measured 0.148)
    local = replace(LOCAL, core_interference=0.148)
    costs = CostModel(local)
    assert costs.contention(2) == pytest.approx(1.148)
    warm = ((0.0, "pirate", 10, 2), (0.0, "haiku", 10, 2))
    alone, _ = simulate(_work(*warm, (30.0, "pirate", 10, 41)), local, POLICIES["fixed-keep-alive"])
    shared, _ = simulate(_work(*warm, (30.0, "pirate", 10, 41), (31.0, "haiku", 10, 2)), local,
                         POLICIES["fixed-keep-alive"])  # fmt: skip
    pass_s = costs.prefill_pass_s(SMOL, [10])
    assert alone.results[2].e2e_s == pytest.approx(pass_s + 40 * _step(1) + local.request_overhead_s)
    slow = costs.contention(2)
    haiku = shared.results[3]
    busy_s = (pass_s + _step(1)) * slow  # haiku's instance runs its pass and one step, both slowed
    assert haiku.e2e_s == pytest.approx(busy_s + local.request_overhead_s)
    # pirate made busy_s / slow steps' worth of progress in busy_s: it ends busy_s (1 - 1 / slow) later
    assert shared.results[2].e2e_s - alone.results[2].e2e_s == pytest.approx(busy_s * (1 - 1 / slow))


def test_a_request_joins_a_running_batch_when_no_instance_can_start() -> None:
    # 700-token prompts: T(1) > the 1 s SLO, so B = 1; one instance at most: the second request does not wait for
    # the first to finish (a whole generation) but joins its worker's batch (`in_flight_limit`), as the agent does
    one = replace(LOCAL, max_instances_per_function=1)
    work = _work((0.0, "pirate", 700, 2), (30.0, "pirate", 700, 30), (30.5, "pirate", 700, 2))
    out, _ = simulate(work, one, POLICIES["fixed-keep-alive"])
    long, joined = out.results[1], out.results[2]
    assert COSTS.prefill_pass_s(SMOL, [700]) > LOCAL.default_slo_ttft_s
    assert joined.sent_s == 30.5
    assert 30.5 + joined.ttft_s < 30.0 + long.e2e_s - 1.0
    # the fixed batch of one stays the hard limit it is: there the second waits for the first to end
    fixed, _ = simulate(work, one, POLICIES["fixed-batch-1"])
    assert fixed.results[2].sent_s == pytest.approx(30.0 + fixed.results[1].e2e_s - LOCAL.request_overhead_s)


def test_a_scale_out_slower_than_the_slo_gives_way_to_a_running_batch() -> None:
    # two GPUs of the paper cluster, no pre-loading: f's instance on one holds B = 1 (a 16k-token prefill outlasts the
    # 1.5 s SLO) and its GPU is busy (one compute slot); a start on the other GPU would take libraries, warm-up and
    # the 13.5 GB backbone (from the node's host tier, where the first start left it), so the third request joins
    # the running batch, and that start begins in the background for what follows;
    # with no room in that worker (batches of 1) the request waits for the start instead
    paper = load_cluster("paper")
    two_gpus = replace(paper, num_nodes=1, devices_per_node=2)
    name = "llama2-7b-a"
    assert paper.functions[name].backbone == "llama2-7b"
    work = _work((0.0, name, 16_000, 2), (60.0, name, 16_000, 400), (61.0, name, 16_000, 2))
    out, _ = simulate(work, two_gpus, POLICIES["no-preload"])
    assert out.num_cold_starts == 2, "the second instance starts in the background"
    size = two_gpus.backbones["llama2-7b"].size_bytes
    assert out.cold_breakdowns[name][0]["backbone"] == pytest.approx(size / two_gpus.loading.disk_bytes_per_s)
    assert out.cold_breakdowns[name][1]["backbone"] == pytest.approx(size / two_gpus.loading.host_to_device_bytes_per_s)
    assert out.results[2].sent_s == 61.0 and not out.results[2].cold
    assert out.results[2].ttft_s < out.results[1].e2e_s - 1.0  # long before the running request ends
    full, _ = simulate(work, replace(two_gpus, max_batch_size=1), POLICIES["no-preload"])
    assert full.num_cold_starts == 2 and full.results[2].cold
    assert full.results[2].cold_start_s > two_gpus.backbones["llama2-7b"].size_bytes / two_gpus.loading.disk_bytes_per_s


# pirate and haiku decode 200 tokens from 30 s; french's 154-token prompt comes at 31 s, all three warm from 0 s
THREE_BUSY = _work((0.0, "pirate", 10, 2), (0.0, "haiku", 10, 2), (0.0, "french", 10, 2),
                   (30.0, "pirate", 10, 200), (30.0, "haiku", 10, 200), (31.0, "french", 154, 2))


@pytest.mark.parametrize("gated", [True, False])
def test_under_the_step_gate_a_pass_has_a_core_and_the_decoders_share_the_other(gated: bool) -> None:
    # three instances busy on two cores: the gate grants french's pass a core for its whole length, so it takes its
    # one-core time, and pirate and haiku step on the core left (half speed while it lasts); processor sharing (no
    # gate) slows all three alike (3 on 2 cores: 1.5x)
    cluster = replace(LOCAL, core_interference=0.0, step_gate=gated)
    costs = CostModel(cluster)
    assert costs.pass_contention(3) == (1.0 if gated else 1.5)
    assert costs.decode_contention(3, passing=1) == (2.0 if gated else 1.5)
    assert costs.decode_contention(3, passing=0) == 1.5  # no pass under way: the cores shared as before
    out, _ = simulate(THREE_BUSY, cluster, POLICIES["fixed-keep-alive"])
    french = out.results[5]
    assert french.ttft_s == pytest.approx(costs.prefill_pass_s(SMOL, [154]) * (1.0 if gated else 1.5)
                                          + cluster.request_overhead_s)


def test_the_step_gate_is_refused_on_a_device_without_cores() -> None:
    data = yaml.safe_load(resources.files("lorafaas.replay").joinpath("clusters", "local.yaml").read_text())
    assert data["device"]["step_gate"] is True  # the shipped CPU cluster models `up`'s default
    del data["device"]["cores"], data["device"]["shared_base"]
    with pytest.raises(ClusterInvalid, match="step_gate is for a CPU device with `cores`"):
        parse_cluster(data, "test.yaml")
