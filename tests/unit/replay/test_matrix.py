"""`lorafaas replay matrix`: the acceptance's cases, the criteria on synthetic numbers, and one real case end to end."""

import json

import pytest

from lorafaas.errors import InvalidInput
from lorafaas.replay.matrix import (
    Metrics,
    all_cases,
    judge,
    run_matrix,
    select_cases,
    select_policies,
    summary_line,
    table,
)
from lorafaas.replay.sim.policies import ABLATIONS


def m(policy: str, mean: float = 0.5, p99: float = 2.0, p999: float = 5.0, slo: float = 0.95,
      cost: float = 10.0) -> Metrics:
    return Metrics(policy, 1000, mean, p99, p999, slo, cost)


def baseline(**ours) -> list[Metrics]:
    """lorafaas (with `ours`), ServerlessLLM, and two ablations, the faster of them `no-preload`."""
    return [m("lorafaas", **ours), m("serverlessllm"), m("no-preload", mean=0.5, cost=12.0),
            m("fixed-keep-alive", mean=0.6, cost=8.0)]


def test_all_criteria_pass_at_the_bounds() -> None:
    verdict = judge("c", baseline(p99=2.0, slo=0.95, p999=6.0, cost=10.0, mean=0.525))
    assert verdict.passed == {"p99": True, "slo": True, "p99.9": True, "cost": True, "best": True}
    assert verdict.all_pass and verdict.best_ablation.policy == "no-preload"


@pytest.mark.parametrize(("ours", "failing"), [
    ({"p99": 2.01}, "p99"),
    ({"slo": 0.949}, "slo"),
    ({"p999": 6.01}, "p99.9"),  # above 1.2 x 5.0
    ({"cost": 10.6}, "cost"),  # above 1.05 x 10.0, below the best ablation's 12.0
    ({"mean": 0.53}, "best"),  # above 1.05 x the best ablation's 0.5
])
def test_each_criterion_fails_alone(ours: dict, failing: str) -> None:
    verdict = judge("c", baseline(**ours))
    assert {c for c, ok in verdict.passed.items() if not ok} == {failing}
    assert not verdict.all_pass


def test_best_ablation_is_the_lowest_mean_and_its_cost_bounds_ours() -> None:
    # within 5% of the fastest ablation's mean but dearer than it: fails, though cheaper than 1.05 x ServerlessLLM
    rows = [m("lorafaas", mean=0.40, cost=9.0), m("serverlessllm", cost=10.0), m("no-sharing", mean=0.39, cost=8.5),
            m("no-offload", mean=0.45, cost=5.0)]
    verdict = judge("c", rows)
    assert verdict.best_ablation.policy == "no-sharing"
    assert verdict.passed["cost"] and not verdict.passed["best"]


def test_judging_needs_serverlessllm_and_an_ablation() -> None:
    with pytest.raises(ValueError, match="serverlessllm"):
        judge("c", [m("lorafaas"), m("no-preload")])
    with pytest.raises(ValueError, match="every ablation"):
        judge("c", [m("lorafaas"), m("serverlessllm")])


def test_cases_are_the_acceptance() -> None:
    names = [c.name for c in all_cases()]
    assert len(names) == 9 + 12 and len(set(names)) == len(names)
    assert {"code/2fn/0-1800", "code/4fn/1800-3600", "code/8fn/0-3600", "bursty/seed4", "predictable/seed1"} <= set(
        names)
    chosen = [c.name for c in select_cases(["code/8fn", "normal/seed2"])]
    assert chosen == ["code/8fn/0-1800", "code/8fn/1800-3600", "code/8fn/0-3600", "normal/seed2"]
    with pytest.raises(InvalidInput, match="matches no case"):
        select_cases(["nothing-like-this"])


def test_summary_counts_cases_passing_everything() -> None:
    verdicts = [judge("a", baseline()), judge("b", baseline(cost=11.0))]
    assert summary_line(verdicts).startswith("1 of 2 cases pass all criteria")
    assert "cost fails in 1" in summary_line(verdicts)
    assert "| b |" in table(verdicts) and "FAIL" in table(verdicts)


def test_one_real_case_in_two_processes() -> None:
    [case] = select_cases(["code/2fn/0-1800"])
    lines: list[str] = []
    [verdict] = run_matrix([case], jobs=2, policies=("lorafaas", "serverlessllm", "no-preload"), progress=lines.append)
    assert len(lines) == 3 and lines[-1].startswith("[3/3] code/2fn/0-1800")
    ours, theirs = verdict.lorafaas, verdict.serverlessllm
    assert ours.num_requests == theirs.num_requests > 1000
    assert ours.ttft_p99_s <= ours.ttft_p999_s and 0 < ours.slo_attainment <= 1
    assert verdict.passed["p99"] and verdict.passed["slo"]  # the command: lorafaas 2.70 s p99 against 6.73


def test_cli_prints_the_table_and_exits_0(cli) -> None:
    result = cli("replay", "matrix", "--case", "code/2fn/0-1800", "--jobs", "2", "--json",
                 "--policy", "lorafaas", "--policy", "serverlessllm", "--policy", "no-preload")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    [case] = document["cases"]
    assert case["case"] == "code/2fn/0-1800" and set(case["passed"]) == {"p99", "slo", "p99.9", "cost", "best"}
    assert document["summary"].split(" (")[0] in ("0 of 1 cases pass all criteria", "1 of 1 cases pass all criteria")
    assert "[3/3] code/2fn/0-1800" in result.stderr  # progress on stderr
    assert select_policies([]) == ("lorafaas", "serverlessllm", *ABLATIONS)  # every ablation by default


@pytest.mark.parametrize(("args", "message"), [
    (("--case", "bogus"), "matches no case"),
    (("--policy", "lorafaas", "--policy", "no-preload"), "need lorafaas, serverlessllm"),
    (("--policy", "serverful"), "is not one the criteria read"),
])
def test_cli_refuses_what_the_criteria_cannot_read(cli, args: tuple[str, ...], message: str) -> None:
    result = cli("replay", "matrix", *args)
    assert result.returncode == 2 and message in " ".join(result.stderr.split()), result.stderr
    assert "Traceback" not in result.stderr
