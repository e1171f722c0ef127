"""`lorafaas bench serve`: the serving benchmark against any OpenAI-compatible server(s), one table per target."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec
import typer
from rich.table import Table

from lorafaas.cli.output import RichProgress, console, print_json, print_table


def _int_list(option: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a comma-separated list of integers", param_hint=option) from None
    if not values or min(values) < 1:
        raise typer.BadParameter(f"{text!r}: give one or more integers >= 1", param_hint=option)
    return values


def _server_pids(specs: list[str], labels: list[str]) -> dict[str, int]:
    """`PID` (with one --url) or `label=PID`, one per target."""
    pids = {}
    for spec in specs:
        label, sep, pid = spec.rpartition("=")
        if not sep:
            if len(labels) != 1:
                raise typer.BadParameter(f"{spec!r}: with several --url give label=PID", param_hint="--server-pid")
            label = labels[0]
        if label not in labels or not pid.isdigit():
            raise typer.BadParameter(f"{spec!r}: expected PID or label=PID with a label of {labels}",
                                     param_hint="--server-pid")
        pids[label] = int(pid)
    return pids


def serve(
    urls: list[str] = typer.Option(..., "--url", help="Server base URL, or label=URL; repeat to compare servers "
                                   "in one run (A/B alternated per level)."),
    models: str = typer.Option(..., "--model", help="Comma-separated model names (functions, LoRA modules); "
                               "requests go to them round-robin."),
    concurrency: str = typer.Option("8,16,32", "--concurrency", help="Comma-separated concurrency levels."),
    requests: int = typer.Option(64, "--requests", min=1, max=100_000, help="Requests per level and target."),
    output_len: int = typer.Option(64, "--output-len", min=1, max=4096, help="max_tokens of every request."),
    prompt_len: int = typer.Option(32, "--prompt-len", min=1, max=4096, help="Words (about tokens) per prompt."),
    seed: int = typer.Option(0, "--seed", help="Seed of the prompts (the same for every target)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Send vLLM's ignore_eos, so replies run to "
                                    "--output-len."),
    api_key: str = typer.Option(None, "--api-key", envvar="LORAFAAS_API_KEY", help="Bearer token for every target."),
    server_pids: list[str] = typer.Option([], "--server-pid", help="PID or label=PID of a server whose process "
                                          "tree's CPU time is reported."),
    warmup: bool = typer.Option(True, "--warmup/--no-warmup", help="One uncounted request per model first."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Serving benchmark of OpenAI-compatible servers: streaming /v1/completions, tokens/s, TTFT/TPOT percentiles."""
    from lorafaas.bench.serve import ServeBenchConfig, parse_target, run_serve_bench

    try:
        targets = [parse_target(spec, i) for i, spec in enumerate(urls)]
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--url") from None
    labels = [t.label for t in targets]
    if len(set(labels)) != len(labels):
        raise typer.BadParameter(f"two targets share a label in {labels}; name them label=URL", param_hint="--url")
    pids = _server_pids(server_pids, labels)
    targets = [msgspec.structs.replace(t, server_pid=pids.get(t.label)) for t in targets]
    names = tuple(name.strip() for name in models.split(",") if name.strip())
    if not names:
        raise typer.BadParameter("give at least one model name", param_hint="--model")
    config = ServeBenchConfig(models=names, concurrencies=_int_list("--concurrency", concurrency), requests=requests,
                              output_len=output_len, prompt_len=prompt_len, seed=seed, ignore_eos=ignore_eos,
                              api_key=api_key, warmup=warmup)
    with RichProgress() as progress:
        try:
            result = run_serve_bench(targets, config, progress)
        except RuntimeError as exc:
            console.print(f"[red]error:[/red] {exc}")
            raise typer.Exit(1) from None
    if as_json:
        print_json(msgspec.to_builtins(result))
    else:
        _print_tables(result)
    if any(level.failed for level in result.levels):
        raise typer.Exit(1)


def _print_tables(result) -> None:
    table = Table("target", "conc", "done/failed", "out tok/s", "req/s", "TTFT p50/p90/p99 (mean) ms",
                  "TPOT p50/p90/p99 (mean) ms", "load: 1m avg, busy/server/other cores", "server PSS peak MB",
                  title=f"bench serve: {len(result.config.models)} models, {result.config.requests} requests per "
                        f"level, {result.config.output_len} output tokens")
    for level in sorted(result.levels, key=lambda lv: (lv.concurrency, lv.target)):
        load = level.load
        shown_load = f"{load.loadavg_1m_start:.1f}->{load.loadavg_1m_end:.1f}, {load.busy_cores:.2f}/" \
                     + (f"{load.server_cores:.2f}/{load.other_cores:.2f}" if load.server_cores is not None else "-/-")
        table.add_row(level.target, str(level.concurrency), f"{level.completed}/{level.failed}",
                      f"{level.output_tokens_per_s:.1f}", f"{level.requests_per_s:.2f}", _dist(level.ttft),
                      _dist(level.tpot), shown_load,
                      "-" if load.server_pss_peak_mb is None else f"{load.server_pss_peak_mb:.0f}")
    print_table(table)
    for level in result.levels:
        if level.short_replies and result.config.ignore_eos:
            console.print(f"[yellow]{level.target} at {level.concurrency}:[/yellow] {level.short_replies} replies "
                          f"stopped before {result.config.output_len} tokens: the server ignores ignore_eos, so its "
                          "tokens/s is over less work than the others'")
        for error in level.errors:
            console.print(f"[red]{level.target} at {level.concurrency}:[/red] {error}")


def _run_bench(run, targets, config, as_json: bool):
    """Run a benchmark with a progress bar: its result, or None once printed as JSON; an error exits 1."""
    with RichProgress() as progress:
        try:
            result = run(targets, config, progress)
        except (RuntimeError, ValueError) as exc:
            console.print(f"[red]error:[/red] {exc}")
            raise typer.Exit(1) from None
    if as_json:
        print_json(msgspec.to_builtins(result))
        return None
    return result


def _dist(d) -> str:
    return f"{d.p50_ms:.0f}/{d.p90_ms:.0f}/{d.p99_ms:.0f} ({d.mean_ms:.0f})"


def new_adapter(
    adapter: Path = typer.Option(..., "--adapter", exists=True, file_okay=False, help="A PEFT adapter directory "
                                 "(vLLM reads it by path: run on the server's machine)."),
    lorafaas_url: str = typer.Option(None, "--lorafaas", help="A lorafaas gateway's base URL."),
    vllm_url: str = typer.Option(None, "--vllm", help="A vLLM server's base URL (started with "
                                 "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)."),
    backbone: str = typer.Option("smollm2-135m", "--backbone", help="lorafaas: the new functions' backbone."),
    repeats: int = typer.Option(5, "--repeats", min=1, max=1000, help="Samples per target (alternated)."),
    output_len: int = typer.Option(16, "--output-len", min=1, max=4096, help="max_tokens of each first request."),
    settle_s: float = typer.Option(3.0, "--settle", min=0.0, max=600.0, help="Seconds of pause before each sample, "
                                   "so the server measured before goes idle."),
    api_key: str = typer.Option(None, "--api-key", envvar="LORAFAAS_API_KEY", help="Bearer token for every target."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """A new adapter's time to first token: a new function on lorafaas, a runtime-loaded LoRA on vLLM."""
    from lorafaas.bench.new_adapter import NewAdapterConfig, NewAdapterTarget, run_new_adapter_bench
    from lorafaas.bench.serve import parse_target

    sources: list[tuple[Literal["lorafaas", "vllm"], str | None]] = [("lorafaas", lorafaas_url), ("vllm", vllm_url)]
    targets = [NewAdapterTarget(kind=kind, url=parse_target(url, 0).url) for kind, url in sources if url]
    if not targets:
        raise typer.BadParameter("give --lorafaas URL, --vllm URL or both", param_hint="--lorafaas")
    config = NewAdapterConfig(adapter_dir=str(adapter), backbone=backbone, repeats=repeats, output_len=output_len,
                              api_key=api_key, settle_s=settle_s)
    result = _run_bench(run_new_adapter_bench, targets, config, as_json)
    if result is None:
        return
    table = Table("target", "register s (median)", "first TTFT s (median)", "total s (median)", "samples (total s)",
                  title=f"new adapter to first token: {repeats} samples each, {output_len} tokens")
    for summary in result.summaries:
        totals = ", ".join(f"{s.total_s:.3f}" for s in result.samples if s.kind == summary.kind)
        table.add_row(summary.kind, f"{summary.median_register_s:.3f}", f"{summary.median_ttft_s:.3f}",
                      f"{summary.median_total_s:.3f}", totals)
    print_table(table)
    for summary in result.summaries:
        if summary.median_stages:
            stages = ", ".join(f"{stage} {seconds * 1e3:.1f}" for stage, seconds in summary.median_stages.items())
            console.print(f"{summary.kind} instance start, median ms per stage: {stages}")
    if len(result.summaries) == 2:
        ratio = result.summaries[0].median_total_s / result.summaries[1].median_total_s
        console.print(f"lorafaas / vllm, median total: {ratio:.2f}x")


def _labelled(option: str, specs: list[str]) -> dict[str, str]:
    """`label=value`, one per target."""
    values: dict[str, str] = {}
    for spec in specs:
        label, sep, value = spec.partition("=")
        if not sep or not label or not value:
            raise typer.BadParameter(f"{spec!r}: expected label=value", param_hint=option)
        if label in values:
            raise typer.BadParameter(f"{label!r} is given twice", param_hint=option)
        values[label] = value
    return values


def server_start(
    urls: list[str] = typer.Option(..., "--url", help="label=URL of a server's base URL (repeat per target)."),
    commands: list[str] = typer.Option(..., "--command", help="label=COMMAND that starts that server in the "
                                       "foreground (split as a shell would; repeat per target)."),
    models: list[str] = typer.Option(..., "--model", help="label=MODEL: the function or adapter the first request "
                                     "names (repeat per target)."),
    repeats: int = typer.Option(3, "--repeats", min=1, max=100, help="Starts per target (alternated)."),
    output_len: int = typer.Option(16, "--output-len", min=1, max=4096, help="max_tokens of each first request."),
    timeout_s: float = typer.Option(600.0, "--timeout", min=1.0, max=7200.0, help="Seconds one start may take."),
    settle_s: float = typer.Option(3.0, "--settle", min=0.0, max=600.0, help="Seconds of pause before each start."),
    log_dir: Path = typer.Option(Path("server-start-logs"), "--log-dir", help="Each start's server output."),
    api_key: str = typer.Option(None, "--api-key", envvar="LORAFAAS_API_KEY", help="Bearer token for every target."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """From launching a server to its first token: each start a new server process, stopped after its first answer."""
    import shlex

    from lorafaas.bench.serve import parse_target
    from lorafaas.bench.server_start import ServerStartConfig, ServerStartTarget, run_server_start_bench

    by_url, by_command, by_model = _labelled("--url", urls), _labelled("--command", commands), \
        _labelled("--model", models)
    for option, given in (("--command", by_command), ("--model", by_model)):
        if set(given) != set(by_url):
            raise typer.BadParameter(f"labels {sorted(given)} differ from --url's {sorted(by_url)}: give each "
                                     "target a --url, a --command and a --model", param_hint=option)
    targets = []
    for label, url in by_url.items():
        try:
            argv = tuple(shlex.split(by_command[label]))
        except ValueError as exc:
            raise typer.BadParameter(f"{label}: {exc}", param_hint="--command") from None
        if not argv:
            raise typer.BadParameter(f"{label}: the command is empty", param_hint="--command")
        try:
            base = parse_target(url, 0).url
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--url") from None
        targets.append(ServerStartTarget(label=label, url=base, model=by_model[label], command=argv))
    config = ServerStartConfig(repeats=repeats, output_len=output_len, api_key=api_key, timeout_s=timeout_s,
                               settle_s=settle_s, log_dir=str(log_dir))
    result = _run_bench(run_server_start_bench, targets, config, as_json)
    if result is None:
        return
    table = Table("target", "first token s (median)", "min / max s", "samples s", "requests until answered",
                  title=f"server start to first token: {repeats} starts each")
    for summary in result.summaries:
        mine = [s for s in result.samples if s.label == summary.label]
        table.add_row(summary.label, f"{summary.median_first_token_s:.2f}",
                      f"{summary.min_first_token_s:.2f} / {summary.max_first_token_s:.2f}",
                      ", ".join(f"{s.first_token_s:.2f}" for s in mine), ", ".join(str(s.attempts) for s in mine))
    print_table(table)
    if len(result.summaries) == 2:
        first, second = result.summaries
        console.print(f"{first.label} / {second.label}, median: "
                      f"{first.median_first_token_s / second.median_first_token_s:.2f}x")
