"""Simulator against a live replay on the same workload (issue 7 acceptance 3).

    python -m lorafaas.replay.compare LIVE_OUT_DIR [--cluster local] [--policy lorafaas] [--cpu-load FILE] [--json]

Reads the live run's `results.json` (written by `lorafaas replay ... --out LIVE_OUT_DIR`), rebuilds the workload it
served (each request's function, arrival time, and its prompt and output lengths as served: the prompt's tokens with
the chat template, as the usage reported them, and the completion tokens the model produced, since the simulator
cannot know where the model stops), simulates it on the
cluster and prints the live and simulated means of TTFT, TPOT and E2E with the relative differences (sim - live) /
live. Requests that failed live are left out of both. With `--cpu-load` (sampled by `lorafaas.replay.cpuload` during
the live run) the simulated CPU device shares its cores with the runnable threads the machine had besides the
platform's workers, window by window (a cluster with `cores`; the shipped `local` has 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from lorafaas.errors import InvalidInput
from lorafaas.replay.cpuload import background_series
from lorafaas.replay.results import RequestResult, summarize
from lorafaas.replay.sim.cluster import load_cluster
from lorafaas.replay.sim.policies import resolve_policies
from lorafaas.replay.sim.runner import simulate
from lorafaas.replay.workload import Request, Workload

METRICS = ("ttft_s", "tpot_s", "e2e_s")


def live_workload(results_json: Path) -> tuple[Workload, list[RequestResult]]:
    """The requests a live run served (errors left out) as a workload, and their live results."""
    try:
        document = json.loads(results_json.read_text())
        rows = document["requests"]
        duration_s = float(document["meta"]["replay_duration_s"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidInput(f"{results_json}: not a live replay's results.json ({exc})") from exc
    if document["meta"].get("mode") != "live":
        raise InvalidInput(f"{results_json}: mode is {document['meta'].get('mode')!r}; compare needs a live run")
    fields = set(RequestResult.__dataclass_fields__)
    live = [RequestResult(**{k: v for k, v in row.items() if k in fields}) for row in rows]
    live = sorted((r for r in live if r.ok and r.completion_tokens > 0), key=lambda r: r.arrival_s)
    if not live:
        raise InvalidInput(f"{results_json}: no request succeeded; nothing to compare")
    requests = tuple(
        Request(r.arrival_s, r.trace_function, r.function, r.usage_prompt_tokens or r.prompt_tokens,
                r.completion_tokens)
        for r in live
    )
    return Workload(requests, duration_s), live


def compare(
    live_dir: Path, cluster: str = "local", policy: str = "lorafaas", seed: int = 0, cpu_load: Path | None = None,
    strict_compute: bool | None = None,
) -> dict:
    """`strict_compute`: the live platform's `--strict-compute` (None: as the cluster file says)."""
    work, live = live_workload(live_dir / "results.json")
    meta = json.loads((live_dir / "results.json").read_text())["meta"]  # read and checked by live_workload
    background: list[tuple[float, float]] = []
    if cpu_load is not None:
        try:
            background = background_series(json.loads(cpu_load.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InvalidInput(f"{cpu_load}: not a cpuload sample file ({exc})") from exc
    spec = load_cluster(cluster)
    if strict_compute is not None:
        spec = dataclasses.replace(spec, strict_compute=strict_compute)
    outcome, row = simulate(work, spec, resolve_policies([policy])[0], seed, background)
    live_all, sim_all = summarize(live)[-1], summarize(outcome.results)[-1]
    out: dict = {"requests": len(live), "cluster": cluster, "policy": policy, "metrics": {}}
    if background:
        out["background_threads_mean"] = sum(b for _, b in background) / len(background)
    for metric in METRICS:
        a, b = getattr(live_all, metric).mean, getattr(sim_all, metric).mean
        diff = None if not a or b is None else (b - a) / a
        out["metrics"][metric] = {"live_mean": a, "sim_mean": b, "relative_difference": diff}
    out["cold_starts"] = {"live": sum(1 for r in live if r.cold), "sim": row.num_cold_starts}
    out["busy_instances_peak"] = {"live": meta.get("busy_instances_peak"), "sim": outcome.busy_peak,
                                  "compute_slots": meta.get("compute_slots"),
                                  "computing_live": meta.get("computing_instances_peak")}
    return out


def format_table(result: dict) -> str:
    shared = result.get("background_threads_mean")
    with_load = "" if shared is None else f", sharing its cores with {shared:.1f} background threads on average"
    title = f"{result['requests']} requests; simulated on `{result['cluster']}` with `{result['policy']}`{with_load}"
    lines = [title, "", "| metric | live mean s | sim mean s | sim vs live |", "|---|---:|---:|---:|"]
    for metric, m in result["metrics"].items():
        diff = "-" if m["relative_difference"] is None else f"{m['relative_difference'] * 100:+.1f}%"
        live = "-" if m["live_mean"] is None else f"{m['live_mean']:.3f}"
        sim = "-" if m["sim_mean"] is None else f"{m['sim_mean']:.3f}"
        lines.append(f"| {metric.removesuffix('_s').upper()} | {live} | {sim} | {diff} |")
    cold = result["cold_starts"]
    lines.append(f"| cold starts | {cold['live']} | {cold['sim']} | |")
    peak = result["busy_instances_peak"]
    live_peak = "-" if peak["live"] is None else str(peak["live"])
    slots = "" if peak["compute_slots"] is None else f"{peak['compute_slots']} compute slots"
    lines.append(f"| busy instances at once (peak) | {live_peak} | {peak['sim']} | {slots} |")
    if peak.get("computing_live") is not None:  # the step gate's count: instances in an engine step
        lines.append(f"| instances computing at once (peak, step gate) | {peak['computing_live']} | | {slots} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("live_dir", type=Path, help="the --out directory of a live `lorafaas replay`")
    parser.add_argument("--cluster", default="local", help="`local`, `paper` or a cluster YAML")
    parser.add_argument("--policy", default="lorafaas")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu-load", type=Path, default=None, help="cpuload samples of the live run")
    parser.add_argument("--strict-compute", action="store_true",
                        help="the live platform ran with `up --strict-compute`: simulate its admission so")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    try:
        result = compare(args.live_dir, args.cluster, args.policy, args.seed, args.cpu_load,
                         strict_compute=True if args.strict_compute else None)
    except InvalidInput as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
