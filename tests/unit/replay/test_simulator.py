"""The simulator: golden metrics for a fixed seed, cold-start arithmetic from the cost model, batching ablations,
cluster validation, and the speed of an 8-function 4-hour paper run."""

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from lorafaas.errors import ClusterInvalid, InvalidInput
from lorafaas.replay.build import WorkloadOptions, build_workload
from lorafaas.replay.sim.cluster import load_cluster, parse_cluster
from lorafaas.replay.sim.costmodel import CostModel
from lorafaas.replay.sim.policies import POLICIES, PolicySpec, resolve_policies
from lorafaas.replay.sim.runner import simulate
from lorafaas.replay.synthetic import generate, write_2019_invocations
from lorafaas.replay.workload import Mapping, Request, Workload

# the mechanics at one thread per instance, without interference between cores; the step gate's lone speedup
# (local.yaml) has its own test below
LOCAL = replace(load_cluster("local"), lone_speedup=1.0, core_interference=0.0)
GOLDEN_TTFT_S = [1.7613, 0.383, 1.4613, 0.4837, 0.29, 0.1087, 0.1758, 0.4781]  # seed 3, local, lorafaas
PAPER = load_cluster("paper")


def _work(*items: tuple[float, str, int, int]) -> Workload:
    reqs = tuple(Request(t, "t", fn, p, o) for t, fn, p, o in items)
    return Workload(reqs, max(r.arrival_s for r in reqs) + 1)


SMALL = _work(
    (0.0, "pirate", 100, 10),
    (0.2, "haiku", 50, 5),
    (0.3, "pirate", 20, 8),
    (5.0, "french", 80, 4),
    (5.1, "pirate", 64, 16),
    (40.0, "haiku", 10, 2),
    (41.0, "haiku", 30, 3),
    (300.0, "french", 120, 6),
)


def test_golden_same_seed_same_metrics() -> None:
    runs = [simulate(SMALL, LOCAL, POLICIES["lorafaas"], seed=3)[0] for _ in range(2)]
    rows = [[(r.ttft_s, r.e2e_s, r.cold) for r in run.results] for run in runs]
    assert rows[0] == rows[1]
    assert runs[0].cost == runs[1].cost
    assert [round(r.ttft_s, 4) for r in runs[0].results] == GOLDEN_TTFT_S
    # the first pirate request pays the cold start (spawn 0.14 s, libraries 0.18 s, the backbone and the adapter at
    # the loader's disk rate, the first forward's warm-up 0.065 s); the second pirate request, held while the
    # dispatcher awaits that start, joins its first pass: 2 prompts padded to 100 tokens, slowed by haiku's instance
    # starting beside it (two busy cores), and the request path's overhead
    first, third = runs[0].results[0], runs[0].results[2]
    start_s = 0.14 + 0.18 + (0.54e9 + 3.7e6) / LOCAL.loading.disk_bytes_per_s + 0.065
    assert first.cold and first.sent_s == 0.0 and first.cold_start_s == pytest.approx(start_s)
    pass_s = CostModel(LOCAL).prefill_pass_s(LOCAL.backbones["smollm2-135m"], [100, 20]) * (1 + LOCAL.core_interference)
    assert first.ttft_s == pytest.approx(start_s + pass_s + LOCAL.request_overhead_s)
    assert third.sent_s == pytest.approx(start_s) and third.ttft_s == pytest.approx(first.ttft_s - 0.3)  # the same pass


def test_cold_start_is_the_sum_of_missing_artifacts() -> None:
    out, _ = simulate(SMALL, LOCAL, POLICIES["no-preload"])
    # pirate first, on an empty device: libraries (0.18 s) + the backbone from disk (0.54 GB at the loader's rate)
    # + the adapter (3.7 MB at that rate) + the first forward's warm-up (0.065 s) + what every start costs (spawn_s)
    first, disk = out.results[0], LOCAL.loading.disk_bytes_per_s
    assert first.cold and first.cold_start_s == pytest.approx(0.14 + 0.18 + 0.54e9 / disk + 3.7e6 / disk + 0.065)
    assert first.ttft_s >= first.cold_start_s
    # haiku's first start binds to the shared copy instead of loading it (two busy processes on two cores: each
    # busy core beyond the first slows both by core_interference)
    busy = CostModel(LOCAL).contention(2)
    assert busy == pytest.approx(1 + LOCAL.core_interference)
    assert out.cold_breakdowns["haiku"][0]["backbone"] == pytest.approx(LOCAL.loading.bind_s * busy)
    alone, _ = simulate(SMALL, LOCAL, POLICIES["serverlessllm"])
    assert alone.cold_breakdowns["haiku"][0]["backbone"] == pytest.approx(
        0.54 / LOCAL.loading.fast_dram_bytes_per_s * 1e9 * busy
    )  # its own copy, from host cache


def test_no_sharing_costs_more() -> None:
    _, row_shared = simulate(SMALL, LOCAL, POLICIES["lorafaas"])
    _, row_alone = simulate(SMALL, LOCAL, POLICIES["no-sharing"])
    assert row_alone.cost > row_shared.cost


def test_fixed_batch_waits_for_its_timeout_or_a_full_batch() -> None:
    work = _work(*[(0.01 * i, "pirate", 10, 2) for i in range(12)])
    out, _ = simulate(work, replace(LOCAL, max_batch_size=16), POLICIES["fixed-batch-10"])  # workers hold 10
    sent = sorted({r.sent_s for r in out.results})
    assert sent[0] == pytest.approx(0.09)  # the tenth arrival fills the first batch
    # the other two wait for the 500 ms timeout of the 11th, and for the shared backbone if it is still loading
    assert sent[1] == pytest.approx(max(0.10 + 0.5, sent[0] + out.results[0].cold_start_s))
    # batches of one: as the agent's `fixed-batch` policy, an instance holds one request at a time; the burst grows
    # the function only while the device has compute to spare (2 cores: 2 busy instances, `may_scale_out`)
    one, _ = simulate(work, LOCAL, POLICIES["fixed-batch-1"])
    assert one.results[0].sent_s == 0.0 and one.num_cold_starts == 2
    four_cores, _ = simulate(work, replace(LOCAL, cores=4.0), POLICIES["fixed-batch-1"])
    assert four_cores.num_cold_starts == LOCAL.max_instances_per_function == 4
    assert all(r.completion_tokens == 2 for r in one.results)


def test_serverful_never_cold_starts_and_bills_every_device() -> None:
    out, row = simulate(SMALL, LOCAL, POLICIES["serverful"])
    assert out.num_cold_starts == 0 and not any(r.cold for r in out.results)
    expected = LOCAL.device_memory_bytes / 1e9 * SMALL.duration_s * LOCAL.price.gpu_active_per_gb_s
    assert row.cost == pytest.approx(expected)


def test_every_policy_serves_every_request() -> None:
    for policy in resolve_policies(["all"]):
        out, row = simulate(SMALL, LOCAL, policy)
        assert all(r.ok and 0 < r.ttft_s <= r.e2e_s for r in out.results), policy.name
        assert row.cost > 0
    with pytest.raises(InvalidInput, match="policy 'fast' is not one of"):
        resolve_policies(["fast"])


def test_cluster_validation_names_field_and_bound(tmp_path: Path) -> None:
    data = yaml.safe_load((Path(__file__).resolve().parents[3] / "lorafaas/replay/clusters/paper.yaml").read_text())
    data["device"]["memory_gb"] = 16
    with pytest.raises(ClusterInvalid, match=r"largest backbone \(26.0 GB\).*exceed a device's 16.0 GB"):
        parse_cluster(data, "x.yaml")
    data["device"]["memory_gb"] = 48
    data["loading"]["loaders"]["standard"]["disk"] = -1
    with pytest.raises(ClusterInvalid, match=r"x.yaml.loading.loaders.standard.disk is -1; it must be in"):
        parse_cluster(data, "x.yaml")
    with pytest.raises(ClusterInvalid, match=r"neither a shipped one \(paper, local, local-bf16\) nor a YAML file"):
        load_cluster(tmp_path / "missing.yaml")


def test_a_cluster_may_start_from_a_shipped_one_and_replace_its_top_level_keys(tmp_path: Path) -> None:
    derived = tmp_path / "mine.yaml"
    derived.write_text("name: mine\nbase: local\nfunctions:\n  - {name: solo, backbone: smollm2-135m, adapter_mb: 9}\n")
    mine, local = load_cluster(derived), load_cluster("local")
    assert mine.name == "mine" and list(mine.functions) == ["solo"]
    assert mine.functions["solo"].adapter_bytes == 9_000_000
    assert (mine.backbones, mine.shared_base, mine.cores) == (local.backbones, local.shared_base, local.cores)
    derived.write_text("name: mine\nbase: elsewhere.yaml\n")
    with pytest.raises(ClusterInvalid, match=r"base is 'elsewhere\.yaml'; expected a shipped cluster"):
        load_cluster(derived)
    bf16 = load_cluster("local-bf16")  # shipped: `local` with the bf16 copy of its backbone
    assert list(bf16.backbones) == ["smollm2-135m-bf16"]
    assert {f.backbone for f in bf16.functions.values()} == {"smollm2-135m-bf16"}
    assert set(bf16.functions) == set(local.functions) and bf16.loading == local.loading


@pytest.mark.parametrize(("path", "key", "message"), [
    ((), "keepalive_s", r"x.yaml: unknown key\(s\) keepalive_s \(did you mean keep_alive_s\?\)"),
    (("device",), "compute_slot", r"x.yaml.device: unknown key\(s\) compute_slot \(did you mean compute_slots\?\)"),
    (("loading",), "disk_gbps", r"x.yaml.loading: unknown key\(s\) disk_gbps"),  # the rates are hardware x fraction
    (("loading", "hardware"), "nvme_gbs",
     r"x.yaml.loading.hardware: unknown key\(s\) nvme_gbs \(did you mean nvme_gbps\?\)"),
    (("backbones", "llama2-7b"), "size", r"x.yaml.backbones.llama2-7b: unknown key\(s\) size"),
    (("functions", 0), "slo_ms", r"x.yaml.functions\[0\]: unknown key\(s\) slo_ms"),
])
def test_a_cluster_key_nobody_reads_is_refused_not_ignored(path: tuple, key: str, message: str) -> None:
    """A misspelt key would leave its default in force without a word; the shipped clusters have none."""
    data = yaml.safe_load((Path(__file__).resolve().parents[3] / "lorafaas/replay/clusters/paper.yaml").read_text())
    parse_cluster(data, "x.yaml")
    target = data
    for step in path:
        target = target[step]
    target[key] = 1
    with pytest.raises(ClusterInvalid, match=message):
        parse_cluster(data, "x.yaml")
    assert load_cluster("local").name == "local"


def test_paper_cluster_8_functions_4_hours_within_30_s(tmp_path: Path) -> None:
    trace = write_2019_invocations(tmp_path / "inv.csv", generate({"normal": 8}, 240, seed=1), 240)
    fns = [f"llama2-{s}-{x}" for s in ("7b", "13b") for x in "abcd"]
    work = build_workload(trace, WorkloadOptions(Mapping.parse([f"*={f}" for f in fns]), select=(("normal", 8),)))
    assert work.functions == tuple(sorted(fns)) and work.duration_s == 4 * 3600
    started = time.perf_counter()
    simulate(work, PAPER, POLICIES["lorafaas"])
    assert time.perf_counter() - started <= 30


def test_lorafaas_admits_as_the_node_agent() -> None:
    """A lone request is dispatched at once to an instance with room (no fill-or-expire wait); while a function's
    instance cold-starts its dispatcher waits, as the agent's does; each request leaves its instance when its own
    output ends."""
    work = _work((0.0, "pirate", 10, 2), (0.1, "pirate", 10, 40), (0.2, "pirate", 10, 2), (30.0, "pirate", 10, 2))
    out, _ = simulate(work, LOCAL, POLICIES["lorafaas"])
    cold_s = out.results[0].cold_start_s
    assert out.results[0].cold and out.results[0].sent_s == 0.0
    # the 2nd and 3rd arrive during the cold start: released when the instance is ready, to that instance
    assert [r.sent_s for r in out.results[1:3]] == [pytest.approx(cold_s)] * 2
    assert out.num_cold_starts == 1
    # warm and idle: the last request is dispatched on arrival and served in one pass, plus the request path
    last = out.results[3]
    one_pass = CostModel(LOCAL).prefill_pass_s(LOCAL.backbones["smollm2-135m"], [10])
    assert last.sent_s == 30.0 and last.ttft_s == pytest.approx(one_pass + LOCAL.request_overhead_s)
    # the paper's rule (the agent with fill_or_expire=True) holds the lone request for d = SLO - T(1)
    held, _ = simulate(work, LOCAL, POLICIES["lorafaas-foe"])
    assert held.results[3].sent_s - 30.0 > 0.3


def test_a_short_request_frees_its_slot_before_its_batch_ends() -> None:
    # at most two in flight per instance, one instance: a (2 tokens) and b (30 tokens) share it (b is released when
    # a's cold start ends); c waits for room, which a leaves when its own output ends (the agent releases each request)
    pairs = PolicySpec("fixed-batch-2", batching="fixed", fixed_batch_size=2)
    one_instance = replace(LOCAL, max_instances_per_function=1)
    work = _work((0.0, "pirate", 10, 2), (0.0, "pirate", 10, 30), (0.05, "pirate", 10, 2))
    out, _ = simulate(work, one_instance, pairs)
    a, b, c = out.results
    assert b.sent_s == pytest.approx(a.cold_start_s)
    assert c.sent_s == pytest.approx(a.arrival_s + a.e2e_s - LOCAL.request_overhead_s)  # its worker is done
    assert c.sent_s < b.arrival_s + b.e2e_s - 1.0


def test_cpu_cores_are_shared_with_busy_instances_and_background_threads() -> None:
    costs = CostModel(LOCAL)  # 2 cores
    i = LOCAL.core_interference  # each busy core beyond the first slows all (shared caches, memory bandwidth)
    assert [costs.contention(n) for n in (1, 2, 3, 4)] == pytest.approx([1.0, 1 + i, 1.5 * (1 + i), 2 * (1 + i)])
    assert costs.contention(1, background_threads=3.0) == pytest.approx(2 * (1 + i))
    assert CostModel(PAPER).contention(3) == pytest.approx(1 + 2 * PAPER.contention)  # GPUs: the linear model
    # a warm request at 20 s while 3 other threads are runnable (from 10 s on): its pass takes (1 + 3) / 2 x (1 + i)
    work = _work((0.0, "pirate", 10, 2), (20.0, "pirate", 10, 2))
    quiet, _ = simulate(work, LOCAL, POLICIES["lorafaas"])
    busy, _ = simulate(work, LOCAL, POLICIES["lorafaas"], background=[(0.0, 0.0), (10.0, 3.0)])
    assert quiet.results[0].ttft_s == busy.results[0].ttft_s
    one_pass = costs.prefill_pass_s(LOCAL.backbones["smollm2-135m"], [10])
    assert quiet.results[1].ttft_s == pytest.approx(one_pass + LOCAL.request_overhead_s)
    assert busy.results[1].ttft_s == pytest.approx(2 * (1 + i) * one_pass + LOCAL.request_overhead_s)


def test_an_instance_computing_alone_on_a_cpu_runs_faster_on_every_core() -> None:
    """The step gate grants a lone instance both cores (LOCAL.lone_speedup 1.5, measured by bench serve)."""
    gated = load_cluster("local")
    costs, i = CostModel(gated), gated.core_interference
    assert gated.lone_speedup == 1.5
    assert costs.contention(1) == pytest.approx(1 / 1.5)
    assert costs.contention(1, background_threads=1.0) == pytest.approx(1.0)  # its 2 threads and 1 other on 2 cores
    assert costs.contention(2) == pytest.approx(1 + i)  # two at once: one core each, as without the gate
    work = _work((0.0, "pirate", 10, 2), (20.0, "pirate", 10, 2))
    out, _ = simulate(work, gated, POLICIES["lorafaas"])
    one_pass = costs.prefill_pass_s(gated.backbones["smollm2-135m"], [10])
    assert out.results[1].ttft_s == pytest.approx(one_pass / 1.5 + gated.request_overhead_s)


def test_free_memory_index_equals_a_recount(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-device artifact bytes kept as residencies come and go, and the active part billing reads, equal a
    recount after every change and bill, through pre-loads, shared and private backbones, evictions and offloads
    (24 functions on 4 small GPUs)."""
    from lorafaas.replay.sim.state import MemoryState

    checked = []
    for name in ("add", "remove", "bill"):
        original = getattr(MemoryState, name)

        def checking(self, r, *args, _original=original):
            _original(self, r, *args)
            for device in self.devices:
                assert self.artifact_total(device) == self.artifact_total_recounted(device)
                assert self.active_artifact_bytes(device) == self.active_artifact_bytes_recounted(device)
            checked.append(1)

        monkeypatch.setattr(MemoryState, name, checking)
    small = replace(PAPER, num_nodes=1, devices_per_node=4)
    fns = [f"f{i}" for i in range(24)]
    work = _work(*[(0.5 * i, fns[(i * 7) % 24], 512, 8) for i in range(300)])
    for policy in ("lorafaas", "no-sharing", "serverlessllm", "instainfer"):
        simulate(work, small, POLICIES[policy])
    assert len(checked) > 500


def test_same_metrics_whatever_the_string_hash_seed() -> None:
    """Golden across processes: nothing the simulator decides may depend on set order, which string hashing
    (PYTHONHASHSEED) changes from one interpreter to the next."""
    script = (  # 200 functions on the paper cluster: set order did change these (before residencies were ordered)
        "import random\n"
        "from lorafaas.replay.sim.cluster import load_cluster\n"
        "from lorafaas.replay.sim.policies import POLICIES\n"
        "from lorafaas.replay.sim.runner import simulate\n"
        "from lorafaas.replay.workload import Request, Workload\n"
        "rng = random.Random(4)\n"
        "fns = [f'f{i}' for i in range(200)]\n"
        "reqs = [Request(rng.uniform(0, 300), 't', rng.choice(fns), rng.choice((256, 1024, 2048)),\n"
        "                rng.choice((8, 64, 256))) for _ in range(1500)]\n"
        "work = Workload(tuple(sorted(reqs, key=lambda r: r.arrival_s)), 300.0)\n"
        "out, row = simulate(work, load_cluster('paper'), POLICIES['lorafaas'])\n"
        "print(row.num_cold_starts, repr(row.cost), [repr(r.ttft_s) for r in out.results][::50])\n"
    )
    runs = [subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "PYTHONHASHSEED": seed},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for seed in ("1", "2")]  # side by side: a minute each, one per core
    outputs = []
    try:
        for run in runs:
            stdout, stderr = run.communicate(timeout=600)
            assert run.returncode == 0, stderr[-3000:]
            outputs.append(stdout)
    finally:  # one failed or timed out: the other is not left running
        for run in runs:
            run.kill()
            run.wait()
    assert outputs[0] == outputs[1] and outputs[0].count("\n") == 1


def test_a_deploy_before_the_trace_lets_pre_loading_stage_the_first_request_s_backbone_and_bills_it() -> None:
    work = _work((0.0, "llama2-13b-a", 512, 8))
    backbone = PAPER.backbones["llama2-13b"]
    size_s = backbone.size_bytes / PAPER.loading.disk_bytes_per_s
    at_once = replace(PAPER, deploy_lead_s=0.0)
    cold, cold_run = simulate(work, at_once, POLICIES["lorafaas"])
    staged, staged_run = simulate(work, replace(PAPER, deploy_lead_s=60.0), POLICIES["lorafaas"])
    assert cold.results[0].cold_start_s >= size_s  # the backbone from disk: deployed the instant it was invoked
    # just deployed, it is expected within the device horizon: staged on the GPU by the deploy's plan, and billed
    assert not staged.results[0].cold and staged.results[0].ttft_s < 1.0
    assert staged_run.cost > cold_run.cost
    # first invoked long after its deploy, it was planned at the floor (once an hour), beyond the horizon: staged in
    # host memory, which is not billed, and its first start copies the backbone to the GPU
    late, late_run = simulate(work, replace(PAPER, deploy_lead_s=1800.0), POLICIES["lorafaas"])
    assert late.results[0].cold and late.results[0].cold_start_s < cold.results[0].cold_start_s
    assert late.cold_breakdowns["llama2-13b-a"][0]["backbone"] == pytest.approx(
        backbone.size_bytes / PAPER.loading.host_to_device_bytes_per_s)
    held_half_an_hour = backbone.size_bytes / 1e9 * 1800 * PAPER.price.gpu_idle_per_gb_s
    assert late_run.cost < staged_run.cost + held_half_an_hour  # the GPU copy went back to host after the horizon
    baseline, _ = simulate(work, replace(PAPER, deploy_lead_s=60.0), POLICIES["serverlessllm"])  # loads on demand
    assert baseline.results[0].ttft_s == simulate(work, at_once, POLICIES["serverlessllm"])[0].results[0].ttft_s
