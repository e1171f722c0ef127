"""`lorafaas bench fleet`: N functions under an open-loop Zipf workload, on lorafaas and on vLLM (bench/fleet.py)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import typer
from rich.table import Table

from lorafaas.cli.output import RichProgress, console, print_json, print_table
from lorafaas.config import LorafaasConfig
from lorafaas.errors import LorafaasError
from lorafaas.platform.batches import MAX_BATCH_FUNCTIONS


def fleet(
    ctx: typer.Context,
    url: str = typer.Option(None, "--url", envvar="LORAFAAS_URL", help="The lorafaas gateway to deploy the fleet "
                            "to [default: the platform the CLI talks to: the local `lorafaas up`]."),
    vllm_url: str = typer.Option(None, "--vllm", help="A vLLM server to run the same workload against "
                                 "(scripts/vllm-cpu.sh --fleet; VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)."),
    rank_blind_url: str = typer.Option(None, "--rank-blind-url", help="A second platform, started with `lorafaas up "
                                       "--rank-blind` and the same admin key (LORAFAAS_ADMIN_KEY), run after --url "
                                       "as `lorafaas-rank-blind`: rank-aware against rank-blind in one run."),
    rank_blind_pid: int = typer.Option(None, "--rank-blind-pid", min=1, help="Its root process [default: the "
                                       "process listening on --rank-blind-url's port]."),
    functions: int = typer.Option(1000, "--functions", min=1, max=10_000, help="Adapters, one function each."),
    duration_s: float = typer.Option(600.0, "--duration", min=1.0, max=86_400.0, help="Seconds of arrivals."),
    rate: float = typer.Option(2.0, "--rate", min=0.01, max=10_000.0, help="Total arrivals per second (Poisson)."),
    zipf: float = typer.Option(1.0, "--zipf", min=0.0, max=10.0, help="Zipf exponent of the function choice."),
    slo_ttft_s: float = typer.Option(1.0, "--slo-ttft", min=0.001, max=3600.0, help="TTFT SLO, seconds."),
    output_len: int = typer.Option(32, "--output-len", min=1, max=4096, help="Output tokens (ignore_eos)."),
    prompt_len: int = typer.Option(32, "--prompt-len", min=1, max=4096, help="Words (about tokens) per prompt."),
    seed: int = typer.Option(0, "--seed", help="Seed of the fleet, the arrivals and the prompts."),
    backbone: str = typer.Option("smollm2-135m", "--backbone", help="A backbone in this home's model store."),
    adapters_dir: Path = typer.Option(None, "--adapters-dir", help="Where the fleet's adapters are written "
                                      "[default: HOME/bench-fleet/BACKBONE]; vLLM reads them there by path."),
    prefix: str = typer.Option("fleet", "--prefix", help="Function and adapter names: PREFIX-00000, ..."),
    batch_size: int = typer.Option(100, "--batch-size", min=1, max=MAX_BATCH_FUNCTIONS,
                                    help="Functions per deploy request."),
    drain_s: float = typer.Option(120.0, "--drain", min=0.0, max=3600.0, help="Seconds requests still running at "
                                  "the end are awaited before they count as failed."),
    lorafaas_pid: int = typer.Option(None, "--lorafaas-pid", min=1, help="lorafaas's root process, whose tree's "
                                     "PSS is sampled [default: the process listening on --url's port]."),
    vllm_pid: int = typer.Option(None, "--vllm-pid", min=1, help="vLLM's root process [default: the process "
                                 "listening on --vllm's port]."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """N functions (mixed ranks and modules) under Poisson arrivals and Zipf popularity; lorafaas (then a rank-blind
    lorafaas), then vLLM."""
    from lorafaas.bench.fleet_run import ServerSpec, run_fleet_bench
    from lorafaas.bench.serve import parse_target
    from lorafaas.formats.model_store import ModelStore
    from lorafaas.platform.api_client import resolve_key, resolve_url
    from lorafaas.testing.fleet_workload import WorkloadSpec

    config: LorafaasConfig = ctx.obj
    bases = {}
    for option, given in (("--url", resolve_url(config, url)), ("--vllm", vllm_url),
                          ("--rank-blind-url", rank_blind_url)):
        if given:
            try:
                bases[option] = parse_target(given, 0).url
            except ValueError as exc:
                raise typer.BadParameter(str(exc), param_hint=option) from None
    if not prefix or not prefix.replace("-", "").isalnum() or not prefix[0].isalpha():
        raise typer.BadParameter(f"{prefix!r}: letters, digits and '-', starting with a letter", param_hint="--prefix")
    try:
        imported = ModelStore(config.home / "models").exists(backbone)
    except LorafaasError as exc:  # a name that cannot be a backbone's
        raise typer.BadParameter(exc.message, param_hint="--backbone") from None
    if not imported:
        raise typer.BadParameter(f"no backbone {backbone!r} in {config.home / 'models'}: import it first "
                                 "(lorafaas backbone import, or lorafaas up --demo)", param_hint="--backbone")
    from lorafaas.bench.fleet import FleetConfig

    bench_config = FleetConfig(
        workload=WorkloadSpec(functions=functions, rate_per_s=rate, zipf_s=zipf, duration_s=duration_s, seed=seed),
        backbone=backbone, adapters_dir=str((adapters_dir or config.home / "bench-fleet" / backbone).resolve()),
        output_len=output_len, prompt_len=prompt_len, slo_ttft_s=slo_ttft_s, batch_size=batch_size,
        drain_s=drain_s, api_key=resolve_key(config))
    vllm = ServerSpec(url=bases["--vllm"], pid=vllm_pid) if "--vllm" in bases else None
    rank_blind = (ServerSpec(url=bases["--rank-blind-url"], pid=rank_blind_pid) if "--rank-blind-url" in bases
                  else None)
    with RichProgress() as progress:
        try:
            result = run_fleet_bench(bench_config, config.home, prefix, ServerSpec(url=bases["--url"],
                                     pid=lorafaas_pid), vllm, progress, rank_blind)
        except ValueError as exc:
            console.print(f"[red]error:[/red] {exc}")
            raise typer.Exit(1) from None
    if as_json:
        print_json(msgspec.to_builtins(result))
    else:
        _print(result)
    if any(server.failed or server.deploy_refused for server in result.servers):
        raise typer.Exit(1)


def _print(result) -> None:
    spec = result.config.workload
    table = Table("figure", *(s.server for s in result.servers),
                  title=f"bench fleet: {spec.functions} functions, {spec.rate_per_s}/s Poisson, Zipf {spec.zipf_s}, "
                        f"{spec.duration_s:.0f} s, {result.arrivals} requests to {result.functions_called} functions")
    rows = [("deploy s", lambda s: f"{s.deploy_s:.1f} ({s.deploy_refused} refused)"),
            ("done / failed", lambda s: f"{s.completed} / {s.failed}"),
            ("TTFT p50 / p99 / p99.9 ms", lambda s: f"{s.ttft_p50_ms:.0f} / {s.ttft_p99_ms:.0f} / "
                                                    f"{s.ttft_p999_ms:.0f}"),
            (f"under SLO {result.config.slo_ttft_s:g} s", lambda s: f"{s.slo_attainment:.1%}"),
            ("E2E p50 / p99 ms", lambda s: f"{s.e2e_p50_ms:.0f} / {s.e2e_p99_ms:.0f}"),
            ("output tokens/s", lambda s: f"{s.output_tokens_per_s:.1f}"),
            ("peak PSS MB", lambda s: "-" if s.peak_pss_mb is None else f"{s.peak_pss_mb:.0f}"),
            ("load: 1m avg, busy / server / other cores",
             lambda s: f"{s.load.loadavg_1m_end:.1f}, {s.load.busy_cores:.2f} / "
                       + ("-" if s.load.server_cores is None else f"{s.load.server_cores:.2f} / "
                          f"{s.load.other_cores:.2f}"))]
    for label, cell in rows:
        table.add_row(label, *(cell(s) for s in result.servers))
    print_table(table)
    for server in result.servers:
        extra = server.lorafaas
        if extra is not None:
            console.print(f"lorafaas: `lorafaas list` {extra.list_cli_s:.2f} s; /metrics {extra.metrics_bytes} bytes "
                          f"in {extra.scrape_ms:.0f} ms; /healthz p99 {extra.healthz_p99_ms:.1f} ms over "
                          f"{extra.healthz_polls} polls every {extra.healthz_interval_s} s ({extra.healthz_failed} "
                          f"failed); cold starts {extra.cold_starts}")
        for reason in server.deploy_refusals:
            console.print(f"[red]{server.server}: deploy refused:[/red] {reason}")
        for reason, count in server.failures.items():
            console.print(f"[red]{server.server}: {count} failed:[/red] {reason}")
