"""The paper-cluster comparison (docs/replay.md, issue 7 acceptance 4): every policy on Predictable, Normal and Bursty
workloads on the `paper` cluster, with ratios against ServerlessLLM.

    python -m lorafaas.replay.sim.paper_table [--functions 8] [--minutes 240] [--seed 1] [--out DIR]

Per class: `synthetic.generate({cls: n}, minutes, seed)` written as a 2019 invocations file (the real day files are
not shipped), `n` functions selected per class and mapped one to one onto the cluster's functions (round-robin past
its eight), Poisson expansion within minutes, prompt and output lengths drawn from the LLM code trace (clipped to
2048 / 512). Prints one Markdown table per class and writes `paper_table.json`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from lorafaas.replay.build import WorkloadOptions, build_workload
from lorafaas.replay.sim.cluster import load_cluster
from lorafaas.replay.sim.policies import resolve_policies
from lorafaas.replay.sim.runner import PolicyResult, simulate
from lorafaas.replay.synthetic import generate, write_2019_invocations
from lorafaas.replay.workload import CLASSES, Mapping, TraceClass, Workload

TOKENS_TRACE = Path(__file__).resolve().parents[3] / "traces" / "AzureLLMInferenceTrace_code.csv"


def class_workload(cls: TraceClass, num_functions: int, minutes: int, seed: int, work_dir: Path) -> Workload:
    names = sorted(load_cluster("paper").functions)
    trace = write_2019_invocations(
        work_dir / f"{cls}.csv", generate({cls: num_functions}, minutes, seed=seed), minutes
    )  # fmt: skip
    targets = [f"*={names[i % len(names)]}" for i in range(num_functions)]
    options = WorkloadOptions(Mapping.parse(targets), seed=seed, tokens_trace=TOKENS_TRACE, max_prompt_tokens=2048,
                              max_output_tokens=512, select=((cls, num_functions),))  # fmt: skip
    return build_workload(trace, options)


def table(rows: list[PolicyResult]) -> str:
    base = next(r for r in rows if r.policy == "serverlessllm")

    def vs(value: float | None, reference: float | None) -> str:
        return "-" if value is None or not reference else f"{(value - reference) / reference * 100:+.0f}%"

    lines = [
        "| policy | cold starts | TTFT mean s | TTFT p99 s | E2E mean s | cost USD | cost-eff. 1/(s·USD) | "
        "TTFT vs SLLM | p99 vs SLLM | cost vs SLLM | cost-eff. vs SLLM |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        s = r.summary
        ce = "-" if r.cost_effectiveness is None else f"{r.cost_effectiveness:.4f}"
        lines.append(
            f"| {r.policy} | {r.num_cold_starts} | {s.ttft_s.mean:.3f} | {s.ttft_s.p99:.3f} | {s.e2e_s.mean:.3f} | "
            f"{r.cost:.2f} | {ce} | {vs(s.ttft_s.mean, base.summary.ttft_s.mean)} | "
            f"{vs(s.ttft_s.p99, base.summary.ttft_s.p99)} | {vs(r.cost, base.cost)} | "
            f"{vs(r.cost_effectiveness, base.cost_effectiveness)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--functions", type=int, default=8, help="functions per class workload")
    parser.add_argument("--minutes", type=int, default=240, help="trace minutes (4 hours as in the paper)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--policy", action="append", default=None, help="policies (default: all)")
    parser.add_argument("--out", type=Path, default=Path("paper-table"))
    args = parser.parse_args(argv)
    cluster = load_cluster("paper")
    policies = resolve_policies(args.policy or ["all"])
    if "serverlessllm" not in {p.name for p in policies}:
        policies += resolve_policies(["serverlessllm"])
    document: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp, Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
    ) as progress:  # fmt: skip
        task = progress.add_task("simulating", total=len(CLASSES) * len(policies))
        for cls in CLASSES:
            work = class_workload(cls, args.functions, args.minutes, args.seed, Path(tmp))
            rows = []
            for policy in policies:
                progress.update(task, description=f"{cls} ({len(work.requests)} requests): {policy.name}")
                rows.append(simulate(work, cluster, policy, args.seed)[1])
                progress.advance(task)
            document[cls] = [r.row() for r in rows]
            progress.console.print(f"\n{cls.capitalize()} ({len(work.requests)} requests, {len(work.functions)} "
                                   f"functions, {args.minutes} min):\n\n{table(rows)}\n")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "paper_table.json").write_text(json.dumps(document, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
