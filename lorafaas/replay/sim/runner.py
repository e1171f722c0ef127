"""Run policies on one workload and cluster; write each policy's report and a comparison.

Cost-effectiveness = 1 / (mean E2E in s x total cost), as in the ServerlessLoRA paper. Ratios are against
`serverlessllm` when it is among the policies: (policy - serverlessllm) / serverlessllm.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lorafaas.replay.report import summary_table, write_report
from lorafaas.replay.results import Summary, summarize
from lorafaas.replay.sim.cluster import ClusterSpec, load_cluster
from lorafaas.replay.sim.engine import SimOutcome, Simulator
from lorafaas.replay.sim.policies import PolicySpec, resolve_policies
from lorafaas.replay.workload import Workload
from lorafaas.stats import percentile


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    summary: Summary  # over all functions
    cost: float
    cost_effectiveness: float | None
    num_cold_starts: int
    num_plans: int
    sim_wall_s: float
    waits: dict[str, int] = field(default_factory=dict)  # why queues waited (admission reason -> times)
    ttft_p999_s: float | None = None
    # the fraction of all requests (errors included) whose first token came within their function's SLO
    slo_attainment: float | None = None

    def row(self) -> dict:
        s = self.summary
        return {
            "policy": self.policy,
            "requests": s.num_requests,
            "cold_starts": self.num_cold_starts,
            "ttft_mean_s": s.ttft_s.mean,
            "ttft_p99_s": s.ttft_s.p99,
            "ttft_p999_s": self.ttft_p999_s,
            "slo_attainment": self.slo_attainment,
            "tpot_mean_s": s.tpot_s.mean,
            "e2e_mean_s": s.e2e_s.mean,
            "e2e_p99_s": s.e2e_s.p99,
            "cost": self.cost,
            "cost_effectiveness": self.cost_effectiveness,
            "plans": self.num_plans,
            "sim_wall_s": self.sim_wall_s,
            "waits": self.waits,
        }


def simulate(
    workload: Workload,
    cluster: ClusterSpec,
    policy: PolicySpec,
    seed: int = 0,
    background: Sequence[tuple[float, float]] = (),
) -> tuple[SimOutcome, PolicyResult]:
    started = time.perf_counter()
    simulator = Simulator(cluster, policy, workload, seed, background)
    outcome = simulator.run()
    wall = time.perf_counter() - started
    overall = summarize(outcome.results)[-1]
    e2e = overall.e2e_s.mean
    ce = 1.0 / (e2e * outcome.cost) if e2e and outcome.cost > 0 else None
    slo_s: dict[str, float] = {str(name): state.spec.slo_ttft_s for name, state in simulator.fns.items()}
    ttfts = [r.ttft_s for r in outcome.results if r.ok and r.ttft_s is not None]
    within = sum(1 for r in outcome.results if r.ok and r.ttft_s is not None and r.ttft_s <= slo_s[r.function])
    return outcome, PolicyResult(
        policy.name, overall, outcome.cost, ce, outcome.num_cold_starts, outcome.num_plans, wall, outcome.waits,
        percentile(ttfts, 99.9), within / len(outcome.results) if outcome.results else None,
    )


def comparison_table(rows: Sequence[PolicyResult], currency: str) -> str:
    base = next((r for r in rows if r.policy == "serverlessllm"), None)

    def ratio(value: float | None, reference: float | None) -> str:
        if base is None or value is None or not reference:
            return "-"
        return f"{(value - reference) / reference * 100:+.0f}%"

    lines = [
        f"| policy | requests | cold starts | TTFT mean s | TTFT p99 s | E2E mean s | E2E p99 s | "
        f"cost {currency} | cost-eff. 1/(s·$) | TTFT vs SLLM | cost vs SLLM |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        s = r.summary
        lines.append(
            f"| {r.policy} | {s.num_requests} | {r.num_cold_starts} | {_f(s.ttft_s.mean)} | {_f(s.ttft_s.p99)} | "
            f"{_f(s.e2e_s.mean)} | {_f(s.e2e_s.p99)} | {r.cost:.4f} | {_f(r.cost_effectiveness, 2)} | "
            f"{ratio(s.ttft_s.mean, base.summary.ttft_s.mean if base else None)} | "
            f"{ratio(r.cost, base.cost if base else None)} |"
        )
    return "\n".join(lines)


def waits_table(rows: Sequence[PolicyResult]) -> str:
    """Why requests waited: how often each policy's admission left a function's queue waiting, by reason
    (`lorafaas.scheduler.admission.AdmissionReason`; the node agent's `describe` shows the same words). The baselines
    admit by their own rules and report none."""
    reasons = sorted({reason for r in rows for reason in r.waits})
    if not reasons:
        return "No queue waited for an instance (no admission waits recorded)."
    lines = ["Times a function's queue waited, by reason:", "",
             "| policy | " + " | ".join(reasons) + " |", "|---|" + "---:|" * len(reasons)]
    for r in rows:
        lines.append(f"| {r.policy} | " + " | ".join(str(r.waits.get(reason, 0)) for reason in reasons) + " |")
    return "\n".join(lines)


def _f(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def run_policies(
    workload: Workload,
    cluster_name: str,
    policy_names: Sequence[str],
    out: Path,
    seed: int,
    meta: Mapping[str, object],
    plots: bool = True,
) -> dict:
    cluster = load_cluster(cluster_name)
    rows: list[PolicyResult] = []
    for policy in resolve_policies(list(policy_names)):
        outcome, row = simulate(workload, cluster, policy, seed)
        rows.append(row)
        write_report(
            out / policy.name,
            outcome.results,
            {
                **meta,
                "mode": "simulated",
                "cluster": cluster.name,
                "policy": policy.name,
                "cost": round(outcome.cost, 6),
                "cold_starts": outcome.num_cold_starts,
                "sim_wall_s": round(row.sim_wall_s, 2),
            },
            outcome.cold_breakdowns,
            plots,
        )
    out.mkdir(parents=True, exist_ok=True)
    price = cluster.price
    text = [
        f"# Simulated replay on `{cluster.name}` ({cluster.num_devices} x {cluster.device_kind}, "
        f"{cluster.device_memory_bytes / 1e9:.0f} GB)",
        "",
        f"- workload: {meta.get('requests')} requests of {meta.get('functions')} over "
        f"{meta.get('replay_duration_s')} s",
        f"- price sheet: {price.name}: GPU memory {price.gpu_active_per_gb_s} {price.currency}/GB-s active, "
        f"{price.gpu_idle_per_gb_s} idle ({price.source})",
        "",
        comparison_table(rows, price.currency),
        "",
        waits_table(rows),
        "",
    ]
    (out / "comparison.md").write_text("\n".join(text))
    document = {"cluster": cluster.name, "meta": dict(meta), "policies": [r.row() for r in rows]}
    (out / "comparison.json").write_text(json.dumps(document, indent=1, default=str))
    if len(rows) == 1:
        text.append(summary_table(summarize(outcome.results)))
    return document
