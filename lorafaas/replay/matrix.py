"""The acceptance matrix of the scheduling issue (39): every case on the `paper` cluster, every policy the criteria
compare (lorafaas, ServerlessLLM, every ablation), one verdict per criterion.

    lorafaas replay matrix [--case SUBSTRING ...] [--policy P ...] [--jobs N] [--json]

Cases: (a) the shipped LLM code trace mapped onto 2, 4 and 8 functions (`llm=f1 ... llm=fN`, as `replay --simulate`
maps it; seed 0) in the windows 0-1800, 1800-3600 and 0-3600 s; (b) the Predictable, Normal and Bursty classes at
seeds 1-4 (8 functions, 240 minutes, as `sim/paper_table.py` builds them). Criteria, lorafaas against:
    p99     TTFT p99 <= ServerlessLLM's
    slo     SLO attainment >= ServerlessLLM's (requests with a first token within their function's SLO, of all)
    p99.9   TTFT p99.9 <= 1.2 x ServerlessLLM's
    cost    cost <= 1.05 x ServerlessLLM's
    best    mean TTFT <= 1.05 x that of the ablation with the lowest mean TTFT, at no more than its cost
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from lorafaas.errors import InvalidInput
from lorafaas.replay.build import WorkloadOptions, build_workload
from lorafaas.replay.sim.cluster import load_cluster
from lorafaas.replay.sim.paper_table import TOKENS_TRACE, class_workload
from lorafaas.replay.sim.policies import ABLATIONS, POLICIES
from lorafaas.replay.sim.runner import PolicyResult, simulate
from lorafaas.replay.workload import CLASSES, Mapping, TraceClass, Workload

CODE_TRACE = TOKENS_TRACE  # the shipped Azure LLM code trace
CODE_FUNCTIONS = (2, 4, 8)
CODE_WINDOWS = ((0.0, 1800.0), (1800.0, 1800.0), (0.0, 3600.0))  # (start s, window s)
CLASS_SEEDS = (1, 2, 3, 4)
CLASS_FUNCTIONS, CLASS_MINUTES = 8, 240
POLICY_NAMES = ("lorafaas", "serverlessllm", *ABLATIONS)
CRITERIA = ("p99", "slo", "p99.9", "cost", "best")
P999_FACTOR, COST_FACTOR, BEST_FACTOR = 1.2, 1.05, 1.05
EPSILON = 1e-9  # ties in floating point are ties


@dataclass(frozen=True)
class Case:
    name: str  # "code/2fn/0-1800", "bursty/seed1"
    trace_class: TraceClass | None  # None: the code trace
    num_functions: int
    seed: int
    start_s: float = 0.0
    window_s: float = 0.0


@dataclass(frozen=True)
class Metrics:
    """What the criteria read of one policy's run."""

    policy: str
    num_requests: int
    ttft_mean_s: float
    ttft_p99_s: float
    ttft_p999_s: float
    slo_attainment: float
    cost: float

    @classmethod
    def of(cls, result: PolicyResult) -> Metrics:
        ttft = result.summary.ttft_s
        return cls(result.policy, result.summary.num_requests, _or_inf(ttft.mean), _or_inf(ttft.p99),
                   _or_inf(result.ttft_p999_s), result.slo_attainment or 0.0, result.cost)  # fmt: skip


@dataclass(frozen=True)
class Verdict:
    case: str
    lorafaas: Metrics
    serverlessllm: Metrics
    best_ablation: Metrics
    passed: dict[str, bool]  # criterion -> pass

    @property
    def all_pass(self) -> bool:
        return all(self.passed.values())

    def row(self) -> dict:
        return {"case": self.case, "lorafaas": vars(self.lorafaas), "serverlessllm": vars(self.serverlessllm),
                "best_ablation": vars(self.best_ablation), "passed": self.passed, "all_pass": self.all_pass}


def _or_inf(value: float | None) -> float:
    return float("inf") if value is None else value


def all_cases() -> list[Case]:
    cases = [
        Case(f"code/{n}fn/{start:.0f}-{start + window:.0f}", None, n, 0, start, window)
        for n in CODE_FUNCTIONS
        for start, window in CODE_WINDOWS
    ]
    cases += [Case(f"{cls}/seed{seed}", cls, CLASS_FUNCTIONS, seed) for cls in CLASSES for seed in CLASS_SEEDS]
    return cases


def select_cases(patterns: Sequence[str]) -> list[Case]:
    """Cases whose name contains any of `patterns` (all cases without patterns)."""
    cases = all_cases()
    if not patterns:
        return cases
    chosen = [c for c in cases if any(p in c.name for p in patterns)]
    if not chosen:
        raise InvalidInput(f"--case {list(patterns)} matches no case; the cases are {[c.name for c in cases]}")
    return chosen


def select_policies(names: Sequence[str]) -> tuple[str, ...]:
    """`names` (all the criteria read without names), checked: lorafaas, serverlessllm and an ablation among them."""
    if not names:
        return POLICY_NAMES
    unknown = [n for n in names if n not in POLICY_NAMES]
    if unknown:
        raise InvalidInput(f"--policy {unknown} is not one the criteria read: {list(POLICY_NAMES)}")
    if not {"lorafaas", "serverlessllm"} <= set(names) or not set(names) & set(ABLATIONS):
        raise InvalidInput("--policy: the criteria need lorafaas, serverlessllm and at least one ablation")
    return tuple(dict.fromkeys(names))


def judge(case: str, metrics: Iterable[Metrics]) -> Verdict:
    """The criteria on one case's metrics (lorafaas, serverlessllm and at least one ablation among them)."""
    by_policy = {m.policy: m for m in metrics}
    missing = {"lorafaas", "serverlessllm"} - set(by_policy)
    ablations = [by_policy[name] for name in ABLATIONS if name in by_policy]
    if missing or not ablations:
        raise ValueError(f"case {case}: the criteria need lorafaas, serverlessllm and an ablation; "
                         f"missing {sorted(missing) or 'every ablation'}")
    ours, theirs = by_policy["lorafaas"], by_policy["serverlessllm"]
    best = min(ablations, key=lambda m: (m.ttft_mean_s, m.cost))
    passed = {
        "p99": ours.ttft_p99_s <= theirs.ttft_p99_s + EPSILON,
        "slo": ours.slo_attainment >= theirs.slo_attainment - EPSILON,
        "p99.9": ours.ttft_p999_s <= P999_FACTOR * theirs.ttft_p999_s + EPSILON,
        "cost": ours.cost <= COST_FACTOR * theirs.cost + EPSILON,
        "best": ours.ttft_mean_s <= BEST_FACTOR * best.ttft_mean_s + EPSILON and ours.cost <= best.cost + EPSILON,
    }
    return Verdict(case, ours, theirs, best, passed)


@lru_cache(maxsize=2)
def case_workload(case: Case) -> Workload:
    """The case's workload (cached: a worker process runs a case's policies one after another)."""
    if case.trace_class is None:
        mapping = Mapping.parse([f"llm=f{i + 1}" for i in range(case.num_functions)])
        options = WorkloadOptions(mapping, seed=case.seed, start_s=case.start_s, window_s=case.window_s)
        return build_workload(CODE_TRACE, options)
    with tempfile.TemporaryDirectory() as tmp:
        return class_workload(case.trace_class, case.num_functions, CLASS_MINUTES, case.seed, Path(tmp))


def run_one(case: Case, policy: str) -> Metrics:
    return Metrics.of(simulate(case_workload(case), load_cluster("paper"), POLICIES[policy], case.seed)[1])


def run_matrix(cases: Sequence[Case], jobs: int = 1, policies: Sequence[str] = POLICY_NAMES,
               progress: Callable[[str], None] | None = None) -> list[Verdict]:
    """Every case with every policy (`jobs` processes), judged; `progress` gets one line per finished run."""
    tasks = [(case, policy) for case in cases for policy in policies]
    results: dict[tuple[str, str], Metrics] = {}
    started = time.perf_counter()

    def done(case: Case, policy: str, metrics: Metrics) -> None:
        results[(case.name, policy)] = metrics
        if progress is not None:
            progress(f"[{len(results)}/{len(tasks)}] {case.name} {policy}: TTFT mean {metrics.ttft_mean_s:.3f} s, "
                     f"cost {metrics.cost:.2f} ({time.perf_counter() - started:.0f} s)")

    if jobs <= 1:
        for case, policy in tasks:
            done(case, policy, run_one(case, policy))
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = [(case, policy, pool.submit(run_one, case, policy)) for case, policy in tasks]
            for case, policy, future in futures:
                done(case, policy, future.result())
    return [judge(case.name, [results[(case.name, p)] for p in policies]) for case in cases]


def table(verdicts: Sequence[Verdict]) -> str:
    """One Markdown row per case: lorafaas / ServerlessLLM / best ablation, then a column per criterion."""
    lines = [
        "| case | requests | TTFT mean s (LF / SLLM / best abl.) | p99 s (LF / SLLM) | p99.9 s (LF / SLLM) | "
        "SLO % (LF / SLLM) | cost USD (LF / SLLM / best abl.) | best ablation | " + " | ".join(CRITERIA) + " |",
        "|---|---:|---:|---:|---:|---:|---:|---|" + ":---:|" * len(CRITERIA),
    ]
    for v in verdicts:
        lf, sl, ab = v.lorafaas, v.serverlessllm, v.best_ablation
        marks = " | ".join("pass" if v.passed[c] else "FAIL" for c in CRITERIA)
        lines.append(
            f"| {v.case} | {lf.num_requests} | {lf.ttft_mean_s:.3f} / {sl.ttft_mean_s:.3f} / {ab.ttft_mean_s:.3f} | "
            f"{lf.ttft_p99_s:.2f} / {sl.ttft_p99_s:.2f} | {lf.ttft_p999_s:.2f} / {sl.ttft_p999_s:.2f} | "
            f"{lf.slo_attainment * 100:.1f} / {sl.slo_attainment * 100:.1f} | "
            f"{lf.cost:.2f} / {sl.cost:.2f} / {ab.cost:.2f} | {ab.policy} | {marks} |"
        )
    return "\n".join(lines)


def summary_line(verdicts: Sequence[Verdict]) -> str:
    failing = {c: sum(1 for v in verdicts if not v.passed[c]) for c in CRITERIA}
    detail = ", ".join(f"{c} fails in {n}" for c, n in failing.items() if n)
    return (f"{sum(1 for v in verdicts if v.all_pass)} of {len(verdicts)} cases pass all criteria"
            + (f" ({detail})" if detail else ""))


def stderr_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
