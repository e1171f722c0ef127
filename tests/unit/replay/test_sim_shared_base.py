"""The simulator's model of the shared base pass (`ClusterSpec.shared_base`): while a round is shorter than the
decoding instances' own steps (the step gate's rule), or from a fixed threshold of them on a CPU device, each makes
one step per round of the pass, and a round's time follows the members and rows in it; otherwise nothing changes."""

from dataclasses import replace

import pytest

from lorafaas.errors import ClusterInvalid
from lorafaas.replay.sim.cluster import PassRound, SharedBaseSpec, load_cluster, parse_cluster
from lorafaas.replay.sim.costmodel import CostModel
from lorafaas.replay.sim.policies import POLICIES, resolve_policies
from lorafaas.replay.sim.runner import simulate
from lorafaas.replay.workload import Request, Workload

# round 50 ms + 10 ms a member + 2 ms a row: far from the one-thread step (84.4 ms), so a step of either kind shows
PASS = SharedBaseSpec(from_members=2, round_s=0.050, per_member_s=0.010, per_row_s=0.002)
LOCAL = replace(load_cluster("local"), lone_speedup=1.0, core_interference=0.0, shared_base=PASS)
COSTS = CostModel(LOCAL)
SMOL = LOCAL.backbones["smollm2-135m"]


def _work(*items: tuple[float, str, int, int]) -> Workload:
    reqs = tuple(Request(t, "t", fn, p, o) for t, fn, p, o in items)
    return Workload(reqs, max(r.arrival_s for r in reqs) + 1)


# pirate and haiku warm from their first requests; at 30 s one request each, 41 tokens: a pass each, then 40 steps
PAIR = ((0.0, "pirate", 10, 2), (0.0, "haiku", 10, 2), (30.0, "pirate", 10, 41), (30.0, "haiku", 10, 41))
TWO_AT_ONCE = _work(*PAIR)


def test_from_the_threshold_every_member_makes_one_step_a_round() -> None:
    out, _ = simulate(TWO_AT_ONCE, LOCAL, POLICIES["lorafaas-shared"])
    pass_s = COSTS.prefill_pass_s(SMOL, [10]) * COSTS.contention(2)
    round_s = COSTS.shared_round_s(members=2, rows=2)
    assert round_s == pytest.approx(0.050 + 2 * 0.010 + 2 * 0.002)
    for res in out.results[2:]:
        assert res.e2e_s == pytest.approx(pass_s + 40 * round_s + LOCAL.request_overhead_s)
    # without the pass, each instance steps on its own at the one-thread step (two on two cores: no slowdown)
    alone, _ = simulate(TWO_AT_ONCE, LOCAL, POLICIES["lorafaas"])
    for res in alone.results[2:]:
        assert res.e2e_s == pytest.approx(pass_s + 40 * COSTS.decode_step_s(SMOL, 1) + LOCAL.request_overhead_s)


def test_below_the_threshold_the_pass_changes_nothing() -> None:
    three = replace(LOCAL, shared_base=replace(PASS, from_members=3))
    shared, _ = simulate(TWO_AT_ONCE, three, POLICIES["lorafaas-shared"])
    plain, _ = simulate(TWO_AT_ONCE, three, POLICIES["lorafaas"])
    assert [(r.ttft_s, r.e2e_s) for r in shared.results] == [(r.ttft_s, r.e2e_s) for r in plain.results]
    assert shared.cost == plain.cost


def test_other_programs_threads_slow_a_round_by_their_share_of_the_cores() -> None:
    assert COSTS.shared_round_s(8, 8, background_threads=2.0) == pytest.approx(2 * COSTS.shared_round_s(8, 8))
    assert COSTS.shared_round_s(8, 8, background_threads=0.0) == pytest.approx(0.050 + 8 * 0.010 + 8 * 0.002)


def test_the_pass_is_refused_on_a_cluster_without_its_model_and_left_out_of_all() -> None:
    with pytest.raises(ClusterInvalid, match="shared_base"):
        simulate(TWO_AT_ONCE, load_cluster("paper"), POLICIES["lorafaas-shared"])
    assert "lorafaas-shared" not in {p.name for p in resolve_policies(["all"])}
    assert resolve_policies(["lorafaas-shared"]) == [POLICIES["lorafaas-shared"]]


def test_without_a_threshold_the_pass_is_taken_when_a_round_beats_the_instances_own_steps() -> None:
    own_step_s = COSTS.decode_step_s(SMOL, 1)  # two instances on two cores: each its own core, no slowdown
    # a round of two: the one-thread step itself + 20 ms a member + 2 ms a row, longer than their own steps
    slower = replace(LOCAL, shared_base=replace(PASS, from_members=None, round_s=own_step_s))
    assert CostModel(slower).shared_round_s(members=2, rows=2) > own_step_s
    shared, _ = simulate(TWO_AT_ONCE, slower, POLICIES["lorafaas-shared"])
    plain, _ = simulate(TWO_AT_ONCE, slower, POLICIES["lorafaas"])
    assert [(r.ttft_s, r.e2e_s) for r in shared.results] == [(r.ttft_s, r.e2e_s) for r in plain.results]
    faster_pass = replace(PASS, from_members=None, round_s=0.020)
    faster = replace(LOCAL, shared_base=faster_pass)
    round_s = CostModel(faster).shared_round_s(members=2, rows=2)
    assert round_s < own_step_s
    out, _ = simulate(TWO_AT_ONCE, faster, POLICIES["lorafaas-shared"])
    pass_s = COSTS.prefill_pass_s(SMOL, [10]) * COSTS.contention(2)
    for res in out.results[2:]:
        assert res.e2e_s == pytest.approx(pass_s + 40 * round_s + LOCAL.request_overhead_s)


# a bf16 copy of the backbone whose rounds cost less, beside the float32 one: a pass per backbone
BF16 = replace(SMOL, name="smollm2-135m-bf16", shared_base=PassRound(0.030, 0.010, 0.001))
TWO_BACKBONES = replace(LOCAL, backbones={**LOCAL.backbones, BF16.name: BF16}, functions={
    **LOCAL.functions, **{f"{name}-bf16": replace(LOCAL.functions[name], name=f"{name}-bf16", backbone=BF16.name)
                          for name in ("pirate", "haiku")}})


def _decode_s(out) -> list[float]:
    """Each of the 41-token requests' time from its first token to its last (40 steps)."""
    return [res.e2e_s - res.ttft_s for res in out.results if res.max_tokens == 41]


def test_a_backbone_with_its_own_model_of_the_round_is_priced_by_it() -> None:
    bf16_pair = _work(*((t, f"{fn}-bf16", p, o) for t, fn, p, o in PAIR))
    out, _ = simulate(bf16_pair, TWO_BACKBONES, POLICIES["lorafaas-shared"])
    round_s = CostModel(TWO_BACKBONES).shared_round_s(members=2, rows=2, backbone=BF16)
    assert round_s == pytest.approx(0.030 + 2 * 0.010 + 2 * 0.001)
    assert _decode_s(out) == pytest.approx([40 * round_s] * 2)
    float32, _ = simulate(TWO_AT_ONCE, TWO_BACKBONES, POLICIES["lorafaas-shared"])  # the device's model, as before
    assert _decode_s(float32) == pytest.approx([40 * COSTS.shared_round_s(members=2, rows=2)] * 2)


def test_each_backbone_decoding_on_a_device_runs_its_own_pass_and_passes_at_once_share_the_cores() -> None:
    four = _work(*((t, f"{fn}{suffix}", p, o) for suffix in ("", "-bf16") for t, fn, p, o in PAIR))
    out, _ = simulate(four, TWO_BACKBONES, POLICIES["lorafaas-shared"])
    costs = CostModel(TWO_BACKBONES)
    rounds = {BF16.name: costs.shared_round_s(2, 2, backbone=BF16), "smollm2-135m": costs.shared_round_s(2, 2)}
    assert rounds[BF16.name] < rounds["smollm2-135m"]
    decode = {res.function: e2e for res, e2e in zip([r for r in out.results if r.max_tokens == 41], _decode_s(out),
                                                      strict=True)}
    together = []
    for name, seconds in decode.items():  # a backbone's round alone until the other's pass starts, then twice it
        round_s = rounds[TWO_BACKBONES.functions[name].backbone]
        assert 40 * round_s * (1 - 1e-9) <= seconds <= 40 * 2 * round_s * (1 + 1e-9), name
        together.append(seconds == pytest.approx(40 * 2 * round_s))
    assert sum(together) >= 2  # the pair whose decode started last had both passes from its first step to its last


def test_a_backbone_s_own_round_takes_only_the_round_s_figures_and_needs_the_device_s_pass() -> None:
    data = _local_yaml()
    backbone = data["backbones"]["smollm2-135m"]
    backbone["shared_base"] = {"round_ms": 30, "per_member_ms": 10, "per_row_ms": 1}
    assert parse_cluster(data, "test.yaml").backbones["smollm2-135m"].shared_base == PassRound(0.030, 0.010, 0.001)
    backbone["shared_base"] = {"from_members": 2, "round_ms": 30, "per_member_ms": 10, "per_row_ms": 1}
    with pytest.raises(ClusterInvalid, match=r"backbones\.smollm2-135m\.shared_base: unknown key.*from_members"):
        parse_cluster(data, "test.yaml")
    backbone["shared_base"] = {"round_ms": 30, "per_member_ms": 10, "per_row_ms": 1}
    del data["device"]["shared_base"]
    with pytest.raises(ClusterInvalid, match=r"shared_base needs device\.shared_base"):
        parse_cluster(data, "test.yaml")


def test_the_shipped_cpu_cluster_models_the_pass_with_the_step_gates_measured_choice() -> None:
    spec = load_cluster("local").shared_base
    assert spec is not None and spec.from_members is None  # no fixed threshold: the faster mode, as `up` by default
    assert load_cluster("paper").shared_base is None


@pytest.mark.parametrize(("block", "message"), [
    ({"from_members": 1, "round_ms": 50, "per_member_ms": 10, "per_row_ms": 2}, "from_members is 1"),
    ({"from_members": 2, "round_ms": 50, "per_member_ms": 10}, "per_row_ms is missing"),
    ({"from_members": 2, "round_ms": 50, "per_member_ms": 10, "per_row_ms": 2, "rows": 3}, "unknown key"),
])
def test_a_bad_model_of_the_pass_is_refused_by_name(block: dict, message: str) -> None:
    data = _local_yaml()
    data["device"]["shared_base"] = block
    with pytest.raises(ClusterInvalid, match=message):
        parse_cluster(data, "test.yaml")


@pytest.mark.parametrize("device", [{"kind": "gpu", "memory_gb": 8}, {"kind": "cpu", "memory_gb": 8}],
                         ids=["gpu", "cpu-without-cores"])
def test_the_pass_is_refused_on_a_device_without_cores(device: dict) -> None:
    data = _local_yaml()
    data["device"] = {**device,
                      "shared_base": {"from_members": 2, "round_ms": 50, "per_member_ms": 10, "per_row_ms": 2}}
    with pytest.raises(ClusterInvalid, match="for a CPU device with `cores`"):
        parse_cluster(data, "test.yaml")


def _local_yaml() -> dict:
    from importlib import resources

    import yaml

    return yaml.safe_load(resources.files("lorafaas.replay").joinpath("clusters", "local.yaml").read_text())
