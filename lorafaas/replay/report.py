"""Replay reports: `results.json`, `requests.csv`, PNG plots and `summary.md` in one output directory.

ttft_cdf.png            TTFT CDF per function
latency_over_time.png   TTFT and E2E of each request against its arrival time, with arrivals per bucket
cold_starts.png         mean cold-start breakdown per function by stage (from the instances seen), if any
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

from lorafaas.replay.results import RequestResult, Summary, summarize


def _fmt(value: float | None, scale: float = 1e3) -> str:
    return "-" if value is None else f"{value * scale:.0f}"


def summary_table(summaries: Sequence[Summary]) -> str:
    lines = [
        "| function | requests | errors | cold | TTFT mean ms | TTFT p50 | TTFT p99 | TPOT mean ms | "
        "E2E mean ms | E2E p50 | E2E p99 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        lines.append(
            f"| {s.function} | {s.num_requests} | {s.num_errors} | {s.num_cold} | {_fmt(s.ttft_s.mean)} | "
            f"{_fmt(s.ttft_s.p50)} | {_fmt(s.ttft_s.p99)} | {_fmt(s.tpot_s.mean)} | {_fmt(s.e2e_s.mean)} | "
            f"{_fmt(s.e2e_s.p50)} | {_fmt(s.e2e_s.p99)} |"
        )
    return "\n".join(lines)


def write_report(
    out_dir: Path,
    results: Sequence[RequestResult],
    meta: Mapping[str, object],
    cold_breakdowns: Mapping[str, Sequence[Mapping[str, float]]] | None = None,
    plots: bool = True,
) -> list[Summary]:
    """Write every report file; returns the summaries (per function, then "all")."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = summarize(results)
    document = {
        "meta": dict(meta),
        "summary": [asdict(s) for s in summaries],
        "requests": [r.row() for r in results],
        "cold_start_breakdowns": {k: list(v) for k, v in (cold_breakdowns or {}).items()},
    }
    (out_dir / "results.json").write_text(json.dumps(document, indent=1, default=str))
    with (out_dir / "requests.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=RequestResult.columns())
        writer.writeheader()
        for r in results:
            writer.writerow(r.row())
    images = []
    if plots:
        images = _plots(out_dir, results, cold_breakdowns or {})
    lines = [f"# Replay summary: {meta.get('trace', '')}", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", summary_table(summaries), ""]
    lines += [f"![{name}]({name})" for name in images]
    errors = [r.error for r in results if r.error]
    if errors:
        lines += ["", f"First errors ({len(errors)} in all):", ""]
        lines += [f"- `{e}`" for e in errors[:5]]
    (out_dir / "summary.md").write_text("\n".join(lines) + "\n")
    return summaries


def _plots(
    out_dir: Path, results: Sequence[RequestResult], cold_breakdowns: Mapping[str, Sequence[Mapping[str, float]]]
) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    ok = [r for r in results if r.ok and r.ttft_s is not None]
    functions = sorted({r.function for r in results})

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for fn in functions:
        values = sorted(r.ttft_s for r in ok if r.function == fn and r.ttft_s is not None)
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=fn)
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF per function")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "ttft_cdf.png", dpi=110)
    plt.close(fig)
    names.append("ttft_cdf.png")

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True, height_ratios=(3, 1))
    for fn in functions:
        mine = [r for r in ok if r.function == fn]
        top.scatter([r.arrival_s for r in mine], [r.e2e_s for r in mine], s=8, marker="o", alpha=0.5, label=f"{fn} E2E")
        top.scatter([r.arrival_s for r in mine], [r.ttft_s for r in mine], s=10, marker="x", label=f"{fn} TTFT")
    cold = [r for r in ok if r.cold]
    if cold:
        top.scatter(
            [r.arrival_s for r in cold],
            [r.ttft_s for r in cold],
            s=60,
            facecolors="none",
            edgecolors="red",
            label="cold start",
        )
    top.set_ylabel("latency (s)")
    top.set_title("Latency over time")
    top.grid(alpha=0.3)
    top.legend(fontsize=7, ncol=2)
    end = max((r.arrival_s for r in results), default=1.0)
    bucket = max(1.0, math.ceil(end / 60))
    counts = [0] * (int(end // bucket) + 1)
    for r in results:
        counts[int(r.arrival_s // bucket)] += 1
    bottom.bar([i * bucket for i in range(len(counts))], counts, width=bucket, align="edge", color="gray")
    bottom.set_ylabel(f"arrivals / {bucket:.0f} s")
    bottom.set_xlabel("arrival time (s)")
    fig.tight_layout()
    fig.savefig(out_dir / "latency_over_time.png", dpi=110)
    plt.close(fig)
    names.append("latency_over_time.png")

    if any(cold_breakdowns.values()):
        stages = sorted({k for bds in cold_breakdowns.values() for bd in bds for k in bd if k != "total"})
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        fns = [fn for fn in sorted(cold_breakdowns) if cold_breakdowns[fn]]
        bottoms = [0.0] * len(fns)
        for stage in stages:
            means = [sum(bd.get(stage, 0.0) for bd in cold_breakdowns[fn]) / len(cold_breakdowns[fn]) for fn in fns]
            ax.bar(fns, means, bottom=bottoms, label=stage)
            bottoms = [b + m for b, m in zip(bottoms, means, strict=True)]
        ax.set_ylabel("seconds (mean over cold starts)")
        ax.set_title("Cold-start breakdown by stage")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "cold_starts.png", dpi=110)
        plt.close(fig)
        names.append("cold_starts.png")
    return names
