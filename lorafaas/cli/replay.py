"""`lorafaas replay TRACE`: drive a running platform with an Azure trace, or simulate a cluster with `--simulate`."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from lorafaas.cli.output import err_console, print_text
from lorafaas.config import LorafaasConfig
from lorafaas.errors import InvalidInput
from lorafaas.platform.api_client import resolve_key, resolve_url
from lorafaas.replay.build import WorkloadOptions, build_workload, parse_select
from lorafaas.replay.report import summary_table, write_report
from lorafaas.replay.workload import Mapping


def replay(
    ctx: typer.Context,
    trace: Path = typer.Argument(..., help="Azure trace: LLM inference CSV, 2019 invocations or 2021 invocations."),
    url: str | None = typer.Option(None, "--url", envvar="LORAFAAS_URL", show_default=False,
                                   help="The lorafaas gateway (live) (default: $LORAFAAS_URL, else the URL `lorafaas "
                                        "up` recorded in the home, else http://127.0.0.1:8080)."),
    mapping: list[str] = typer.Option([], "--map", help="TRACE_FN=FUNCTION (repeatable; `*` matches every trace "
                                                        "function; the LLM trace is one trace function)."),
    speedup: float = typer.Option(1.0, "--speedup", help="Divide arrival times by this."),
    duration: float | None = typer.Option(None, "--duration", help="Stop after this many seconds of replay."),
    start: float = typer.Option(0.0, "--start", help="Skip this many seconds of trace first."),
    window: float | None = typer.Option(None, "--window", help="Seconds of trace (after --start) to use."),
    sample: float = typer.Option(1.0, "--sample", help="Keep this fraction of requests (seeded thinning)."),
    seed: int = typer.Option(0, "--seed", help="Seed of every random choice."),
    select: str | None = typer.Option(None, "--select", help="2019/2021: CLASS:N,... trace functions per CoV class "
                                                             "(predictable, normal, bursty), mapped onto `*=...`."),
    expansion: str = typer.Option("poisson", "--expansion", help="2019 minute counts: uniform | poisson."),
    tokens: Path | None = typer.Option(None, "--tokens", help="LLM trace to draw 2019/2021 token lengths from."),
    max_prompt_tokens: int | None = typer.Option(None, "--max-prompt-tokens", help="Clip prompt lengths."),
    max_output_tokens: int | None = typer.Option(None, "--max-output-tokens", help="Clip output lengths."),
    concurrency: int = typer.Option(64, "--concurrency", help="Live: most requests in flight."),
    out: Path = typer.Option(Path("replay-out"), "--out", help="Directory for the report files."),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="Write PNG plots."),
    simulate: bool = typer.Option(False, "--simulate", help="Simulate a cluster instead of driving a platform."),
    cluster: str = typer.Option("local", "--cluster", help="Simulator: `paper`, `local` or a cluster YAML path."),
    policy: list[str] = typer.Option([], "--policy", help="Simulator policy (repeatable; `all`): lorafaas, "
                                                          "no-sharing, no-preload, no-offload, fixed-batch-1, ...; "
                                                          "lorafaas-shared (CPU clusters: the shared base pass)"),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON document."),
) -> None:
    """Replay an Azure trace against a running platform (or a simulated cluster) and write a report. `lorafaas replay
    matrix`: the scheduling acceptance on the paper cluster (its own --help)."""
    if expansion not in ("uniform", "poisson"):
        raise InvalidInput(f"--expansion is {expansion!r}; choose uniform or poisson")
    if not mapping:
        raise InvalidInput("give at least one --map TRACE_FN=FUNCTION (e.g. --map 'llm=pirate' or --map '*=pirate')")
    options = WorkloadOptions(Mapping.parse(mapping), seed, start, window, speedup, duration, sample,
                              max_prompt_tokens, max_output_tokens, expansion, tokens,  # type: ignore[arg-type]
                              parse_select(select))
    workload = build_workload(trace, options)
    meta = {"trace": str(trace), "requests": len(workload.requests), "functions": ", ".join(workload.functions),
            "trace_window_s": window, "start_s": start, "speedup": speedup, "sample": sample, "seed": seed,
            "replay_duration_s": round(workload.duration_s, 3)}
    if simulate:
        from lorafaas.replay.sim.runner import run_policies

        document = run_policies(workload, cluster, policy or ["lorafaas"], out, seed, meta, plots)
        if as_json:
            typer.echo(json.dumps(document, indent=2, default=str))
        else:
            print_text((out / "comparison.md").read_text(), end="")  # Markdown: verbatim, never wrapped
        return
    config: LorafaasConfig = ctx.obj
    from lorafaas.replay.live import LiveConfig, run_live

    url = resolve_url(config, url)
    live = LiveConfig(url, resolve_key(config), max_in_flight=concurrency)
    err_console.print(f"replaying {len(workload.requests)} requests over {workload.duration_s:.0f} s onto "
                      f"{', '.join(workload.functions)} at {url}")
    with Progress(TextColumn("replay"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console) as progress:
        task = progress.add_task("replay", total=len(workload.requests))
        run = asyncio.run(run_live(workload, live, lambda n, _total: progress.update(task, completed=n)))
    breakdowns: dict[str, list[dict[str, float]]] = {}
    for inst in run.instances.values():
        if inst.cold_start:
            breakdowns.setdefault(inst.function, []).append(inst.cold_start)
    meta |= {"mode": "live", "url": url, "wall_s": round(run.wall_s, 2), "instances_started": len(run.instances),
             "busy_instances_peak": run.busy_peak, "compute_slots": run.compute_slots,
             "computing_instances_peak": run.computing_peak}
    summaries = write_report(out, run.results, meta, breakdowns, plots)
    if as_json:
        typer.echo(json.dumps(json.loads((out / "results.json").read_text())["summary"], indent=2))
    else:
        print_text(summary_table(summaries))  # a Markdown table: verbatim, never wrapped
        err_console.print(f"report in {out}/ (results.json, requests.csv, summary.md, plots)")


def matrix(
    case: list[str] = typer.Option([], "--case", help="Run only the cases whose name contains this (repeatable): "
                                                      "code/2fn/0-1800, bursty/seed1, code/8fn, normal, ..."),
    policy: list[str] = typer.Option([], "--policy", help="Run only these policies (repeatable; default: lorafaas, "
                                                          "serverlessllm and every ablation, what the criteria read)."),
    jobs: int = typer.Option(1, "--jobs", min=1, max=64, help="Simulations run at once (processes)."),
    as_json: bool = typer.Option(False, "--json", help="Print the verdicts as one JSON document."),
) -> None:
    """The scheduling acceptance on the paper cluster: every case, lorafaas against ServerlessLLM and every ablation,
    a pass/fail column per criterion. Exits 0 whatever the verdicts; the last line counts the cases that pass."""
    from lorafaas.replay.matrix import run_matrix, select_cases, select_policies, stderr_progress, summary_line, table

    verdicts = run_matrix(select_cases(case), jobs, select_policies(policy), stderr_progress)
    if as_json:
        typer.echo(json.dumps({"cases": [v.row() for v in verdicts], "summary": summary_line(verdicts)}, indent=1))
    else:
        print_text(table(verdicts) + "\n\n" + summary_line(verdicts))


def fleet(
    functions: int = typer.Option(1000, "--functions", min=1, max=100_000, help="Functions in the fleet."),
    rate: float = typer.Option(10.0, "--rate", min=0.001, max=10_000.0, help="Total arrivals per second (Poisson)."),
    zipf: float = typer.Option(1.0, "--zipf", min=0.0, max=10.0, help="Zipf exponent of the functions' popularity."),
    duration: float = typer.Option(600.0, "--duration", min=1.0, max=86_400.0, help="Seconds of arrivals."),
    prompt_tokens: int = typer.Option(32, "--prompt-tokens", min=1, max=32_768, help="Every prompt's length."),
    output_tokens: int = typer.Option(32, "--output-tokens", min=1, max=32_768, help="Every reply's length."),
    cluster: str = typer.Option("paper", "--cluster", help="paper, or a cluster YAML whose backbones give widths."),
    policy: list[str] = typer.Option([], "--policy", help="Policies (repeatable; default: lorafaas, "
                                                          "lorafaas-rank-blind, serverlessllm)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the adapters' shapes and of the arrivals."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as one JSON document."),
) -> None:
    """The fleet benchmark's workload simulated (issue 41): N functions of mixed adapter ranks and target modules,
    Zipf popularity, Poisson arrivals; TTFT, cost and the scheduler's plan time per policy."""
    from lorafaas.replay.fleet import FLEET_POLICIES, FleetOptions, fleet_table, run_fleet
    from lorafaas.replay.sim.cluster import load_cluster

    options = FleetOptions(functions, rate, zipf, duration, prompt_tokens, output_tokens, seed)
    document = run_fleet(options, load_cluster(cluster), policy or FLEET_POLICIES)
    if as_json:
        typer.echo(json.dumps(document, indent=1))
    else:
        print_text(fleet_table(document))
