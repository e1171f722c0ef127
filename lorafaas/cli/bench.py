"""`lorafaas bench ...`: measurements printed as one JSON document (`--json`) or a table."""

from __future__ import annotations

from pathlib import Path

import msgspec
import typer
from rich.table import Table

from lorafaas.cli import bench_fleet, bench_serve
from lorafaas.cli.output import RichProgress, human_bytes, print_json, print_table
from lorafaas.config import LorafaasConfig
from lorafaas.platform.demo_functions import DEMO_ADAPTERS_DIR, demo_adapter_dirs

app = typer.Typer(help="Benchmarks of the platform's mechanisms.", no_args_is_help=True)


@app.command("products")
def products(
    ctx: typer.Context,
    backbone: str = typer.Option("smollm2-135m", "--backbone", help="A backbone in the model store."),
    rows: str = typer.Option("1,2,4,8,16,32", "--rows", help="Rows of a round (comma-separated)."),
    dtype: str = typer.Option("float32,bfloat16", "--dtype", help="float32 and/or bfloat16 (converted in memory)."),
    repeats: int = typer.Option(7, "--repeats", help="Timed rounds of each case (median)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """One round of the shared base pass's products against a streaming read of the same weights."""
    from lorafaas.bench.products import parse_dtypes, parse_rows, run_products_bench

    config: LorafaasConfig = ctx.obj
    row_counts, dtypes = parse_rows(rows), parse_dtypes(dtype)
    with RichProgress() as progress:
        result = run_products_bench(config.home, backbone, row_counts, dtypes, repeats, progress)
    if as_json:
        print_json(msgspec.to_builtins(result))
        return
    table = Table("dtype", "rows", "threads", "kernel", "weights", "products", "GB/s", "streaming read", "GB/s",
                  "products / read", title=f"{backbone}: one round ({result.groups_per_round} calls), median of "
                  f"{result.repeats}; read: {result.streaming_method}; load {result.load_average[0]:.1f}"
                  f"-{result.load_average[1]:.1f}")
    for case in result.cases:
        table.add_row(case.dtype, str(case.rows), str(case.threads), case.kernel, human_bytes(case.weight_bytes),
                      f"{case.products_s * 1e3:.1f} ms", f"{case.products_gb_s:.1f}",
                      f"{case.streaming_s * 1e3:.1f} ms", f"{case.streaming_gb_s:.1f}",
                      f"{case.ratio_products_over_streaming:.2f}x")
    print_table(table)


@app.command("attach")
def attach(
    ctx: typer.Context,
    backbone: str = typer.Option("smollm2-135m", "--backbone", help="A backbone in the model store."),
    repeats: int = typer.Option(5, "--repeats", min=1, max=50, help="Fresh processes of each kind (median)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Private from_pretrained vs attaching to the shared backbone (lease, map, empty model, bind), fresh processes."""
    from lorafaas.bench.daemon import run_attach_bench

    config: LorafaasConfig = ctx.obj
    with RichProgress() as progress:
        result = run_attach_bench(config.home, backbone, repeats, progress)
    if as_json:
        print_json(msgspec.to_builtins(result))
        return
    table = Table("backbone", "bytes", "private load", "attach", "of which bind", "private / attach")
    table.add_row(result.backbone, human_bytes(result.bytes), f"{result.private_load_s * 1e3:.1f} ms",
                  f"{result.attach_s * 1e3:.1f} ms", f"{result.bind_s * 1e3:.2f} ms",
                  f"{result.ratio_private_over_attach:.1f}x")
    print_table(table)


def _default_adapter() -> Path:
    return DEMO_ADAPTERS_DIR / "pirate"


def _show(result: msgspec.Struct, as_json: bool, title: str) -> None:
    document = msgspec.to_builtins(result)
    if as_json:
        print_json(document)
        return
    table = Table("measure", "value", title=title)
    for key, value in document.items():
        if isinstance(value, dict):
            for case, steps in value.items():
                shown = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in steps.items()) if isinstance(steps, dict) \
                    else str(steps)
                table.add_row(f"{key}.{case}", shown)
        else:
            table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    print_table(table)


@app.command("coldstart")
def coldstart(
    ctx: typer.Context,
    backbone: str = typer.Option("smollm2-135m", "--backbone"),
    adapter: Path = typer.Option(None, "--adapter", help="Adapter directory (default: the pirate demo adapter)."),
    repeats: int = typer.Option(3, "--repeats", min=1, max=20, help="Samples of each case (median)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Time to first token: conventional process vs cold, pool-forked, pre-loaded and warm lorafaas instances."""
    from lorafaas.bench.coldstart import run_coldstart_bench

    config: LorafaasConfig = ctx.obj
    with RichProgress() as progress:
        result = run_coldstart_bench(config.home, backbone, adapter or _default_adapter(), repeats, progress)
    _show(result, as_json, f"cold starts on {backbone}")


@app.command("memory")
def memory(
    ctx: typer.Context,
    backbone: str = typer.Option("smollm2-135m", "--backbone"),
    functions: int = typer.Option(8, "--functions", min=2, max=32, help="Functions with distinct adapters."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """PSS of N lorafaas functions on one shared backbone vs N conventional processes."""
    from lorafaas.bench.memory import bench_adapters, run_memory_bench

    config: LorafaasConfig = ctx.obj
    demo = demo_adapter_dirs()
    with RichProgress() as progress:
        adapters = bench_adapters(config.home, backbone, demo, functions)
        result = run_memory_bench(config.home, backbone, adapters, progress)
    _show(result, as_json, f"memory of {functions} functions on {backbone}")


@app.command("throughput")
def throughput(
    ctx: typer.Context,
    backbone: str = typer.Option("smollm2-135m", "--backbone"),
    adapter: Path = typer.Option(None, "--adapter", help="Adapter directory (default: the pirate demo adapter)."),
    concurrency: int = typer.Option(8, "--concurrency", min=2, max=16),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1, max=512),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """One function's tokens per second at 1 vs N concurrent requests (continuous batching)."""
    from lorafaas.bench.throughput import run_throughput_bench

    config: LorafaasConfig = ctx.obj
    with RichProgress() as progress:
        result = run_throughput_bench(config.home, backbone, adapter or _default_adapter(), concurrency, max_tokens,
                                      progress)
    _show(result, as_json, f"throughput on {backbone}")


@app.command("control-plane")
def control_plane(
    functions: int = typer.Option(1000, "--functions", min=1, max=10_000, help="Functions deployed (tiny backbone)."),
    batch_size: int = typer.Option(100, "--batch-size", min=1, max=500, help="Functions per deploy request."),
    sample: int = typer.Option(20, "--sample", min=1, max=1000, help="Functions deployed one a request (baseline)."),
    invoked: int = typer.Option(3, "--invoked", min=0, max=100, help="Functions invoked once (their series)."),
    repeats: int = typer.Option(5, "--repeats", min=1, max=50, help="Timed runs of each read (median)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Per-function costs at N functions: batch deploy against one a request, list, describe, /metrics."""
    from lorafaas.bench.control_plane import run_control_plane_bench

    with RichProgress() as progress:
        result = run_control_plane_bench(functions, batch_size, sample, invoked, repeats, progress)
    _show(result, as_json, f"the control plane at {functions} functions")


@app.command("scheduler")
def scheduler(
    repeats: int = typer.Option(15, "--repeats", min=1, max=200, help="Timed runs of each decision (median)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the synthetic views."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Decision times of the pure scheduling policies on synthetic views (pre-load plan, batch, offload)."""
    from lorafaas.bench.scheduler import run_scheduler_bench

    _show(run_scheduler_bench(repeats, seed), as_json, "scheduler decision times")


@app.command("batching")
def batching(
    ctx: typer.Context,
    bursts: int = typer.Option(3, "--bursts", min=1, max=50),
    burst_size: int = typer.Option(24, "--burst-size", min=1, max=500, help="Requests per burst, over 3 functions."),
    gap_s: float = typer.Option(10.0, "--gap", min=0.0, help="Seconds between bursts."),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1, max=512),
    slo_ttft_ms: int = typer.Option(2000, "--slo-ttft-ms", min=1, help="The demo functions' TTFT SLO."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Bursty load on the demo functions: adaptive batching vs batch size 1, each on a fresh platform."""
    from lorafaas.bench.live import run_batching_bench
    from lorafaas.formats.model_store import ModelStore

    config: LorafaasConfig = ctx.obj
    with RichProgress() as progress:
        result = run_batching_bench(ModelStore(config.models_dir), bursts, burst_size, gap_s, max_tokens,
                                    slo_ttft_ms, progress=progress)
    if as_json:
        print_json(msgspec.to_builtins(result))
        return
    table = Table("policy", "requests/s", "TTFT SLO met", "mean TTFT", "p99 TTFT", "errors",
                  title=f"{bursts} bursts of {burst_size} requests, SLO {result.slo_ttft_ms} ms")
    for policy, row in result.policies.items():
        table.add_row(policy, f"{row.requests_per_s:.2f}", f"{row.ttft_slo_attainment:.0%}",
                      f"{row.mean_ttft_s * 1e3:.0f} ms", f"{row.p99_ttft_s * 1e3:.0f} ms", str(row.errors))
    print_table(table)


@app.command("preload")
def preload(
    ctx: typer.Context,
    rounds: int = typer.Option(2, "--rounds", min=1, max=20, help="Cold invocations of each demo function."),
    keep_alive_s: float = typer.Option(2.0, "--keep-alive", min=0.5, max=60.0),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Cold invocations with pre-loading on and off, each on a fresh platform."""
    from lorafaas.bench.live import run_preload_bench
    from lorafaas.formats.model_store import ModelStore

    config: LorafaasConfig = ctx.obj
    with RichProgress() as progress:
        result = run_preload_bench(ModelStore(config.models_dir), rounds, keep_alive_s, progress)
    _show(result, as_json, "cold invocations, pre-loading on (lorafaas) and off (no-preload)")


@app.command("traffic")
def traffic(
    ctx: typer.Context,
    clients: int = typer.Option(20, "--clients", min=1, max=500, help="Concurrent closed-loop streaming clients."),
    duration_s: float = typer.Option(300.0, "--duration", min=1.0, help="Seconds of load."),
    max_tokens: int = typer.Option(16, "--max-tokens", min=1, max=512),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Closed-loop load on the demo functions: nothing lost or duplicated, requests/s and TTFT percentiles."""
    from lorafaas.bench.traffic import run_traffic_bench
    from lorafaas.formats.model_store import ModelStore

    config: LorafaasConfig = ctx.obj
    with RichProgress() as progress:
        result = run_traffic_bench(ModelStore(config.models_dir), clients, duration_s, max_tokens, progress)
    _show(result, as_json, f"{clients} clients for {duration_s:g} s")


@app.command("load")
def load(
    ctx: typer.Context,
    backbone: str = typer.Option("smollm2-135m", "--backbone", help="A backbone in the model store."),
    size_mb: int = typer.Option(None, "--size-mb", min=1, max=65536,
                                help="Load a synthetic safetensors file of this many MiB instead of the backbone."),
    repeats: int = typer.Option(3, "--repeats", min=1, max=20, help="Runs of each reader (median)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """The backbone loader's GB/s from a cold file, the page cache and the host tier, against the limits beside it."""
    from lorafaas.bench.load import run_loader_bench
    from lorafaas.formats.model_store import ModelStore

    config: LorafaasConfig = ctx.obj
    store = None if size_mb is not None else ModelStore(config.models_dir)
    with RichProgress() as progress:
        result = run_loader_bench(store, backbone, size_mb, repeats, progress)
    if as_json:
        print_json(msgspec.to_builtins(result))
        return
    table = Table("tier", "loader GB/s", "limit GB/s", "of limit", "reads alone", "of limit", "new-memory limit",
                  "of it", "safetensors GB/s", title=f"{result.source}, {human_bytes(result.bytes_loaded)}, median of "
                  f"{result.repeats}" + ("" if result.cold_dropped else "; the cold file could NOT be dropped "
                                         f"({result.cold_resident_fraction:.0%} stayed cached)"))
    for tier in ("cold", "page_cache", "host_tier"):
        row = getattr(result, tier)
        table.add_row(tier, f"{row.loader_gbps:.2f}", f"{row.limit_gbps:.2f}", f"{row.fraction_of_limit:.0%}",
                      f"{row.fill_gbps:.2f}", f"{row.fill_fraction_of_limit:.0%}",
                      f"{row.new_memory_limit_gbps:.2f}", f"{row.fraction_of_new_memory_limit:.0%}",
                      "-" if row.safetensors_gbps is None else f"{row.safetensors_gbps:.2f}")
    print_table(table)
    typer.echo(f"host tier on a CPU daemon: the kept segment is adopted as is in "
               f"{result.host_tier_adoption_ms:.2f} ms (no byte copied)")


@app.command("soak")
def soak(
    ctx: typer.Context,
    duration_s: float = typer.Option(1800.0, "--duration", min=1.0, help="Seconds of bursts and scale-to-zero."),
    keep_alive_s: float = typer.Option(5.0, "--keep-alive", min=0.5, max=600.0),
    burst: int = typer.Option(6, "--burst", min=1, max=100, help="Requests per function in each burst."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Bursts with scale-to-zero between them: platform memory growth, leaked segments and processes afterwards."""
    from lorafaas.bench.traffic import run_soak_bench
    from lorafaas.formats.model_store import ModelStore

    config: LorafaasConfig = ctx.obj
    with RichProgress() as progress:
        result = run_soak_bench(ModelStore(config.models_dir), duration_s, keep_alive_s, burst, progress=progress)
    _show(result, as_json, f"soak for {duration_s:g} s")


@app.command("edge")
def edge(
    redos: bool = typer.Option(True, "--redos/--no-redos", help="Also upload a target_modules regex that backtracks."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """/healthz latency while one tenant attacks: 1 MB unknown names, scrapes, hostile and huge adapter uploads."""
    from lorafaas.bench.edge import run_edge_bench

    with RichProgress() as progress:
        result = run_edge_bench(redos, progress)
    if as_json:
        print_json(result)
        return
    table = Table("measure", "value", title="/healthz while a tenant attacks")
    for key, value in result.items():
        table.add_row(key, str(value))
    print_table(table)


@app.command("moe-transport")
def moe_transport(
    repeats: int = typer.Option(20, "--repeats", min=3, max=500, help="Timed layers per transport and size (median)."),
    rank: int = typer.Option(16, "--rank", min=1, max=256, help="Rank of the expert adapter."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """One MoE layer's LoRA round trip to the LoRA server: shared memory vs TCP vs naive HTTP+JSON, same run."""
    from lorafaas.bench.moe_transport import run_moe_transport_bench

    with RichProgress() as progress:
        result = run_moe_transport_bench(progress, repeats=repeats, rank=rank)
    if as_json:
        print_json(msgspec.to_builtins(result))
        return
    table = Table("tokens", "rows", "shm", "tcp", "HTTP+JSON", "HTTP / shm",
                  title=f"per-layer round trip, Mixtral-8x7B layer, rank {result.rank}")
    for row in result.sizes:
        table.add_row(str(row.tokens), str(row.rows), f"{row.shm_ms:.2f} ms", f"{row.tcp_ms:.2f} ms",
                      f"{row.http_json_ms:.1f} ms", f"{row.http_over_shm:.0f}x")
    print_table(table)


@app.command("hostile")
def hostile(
    ctx: typer.Context,
    backbone: str = typer.Option("smollm2-135m", "--backbone", help="A backbone in the model store."),
    members: int = typer.Option(2, "--members", min=2, max=8, help="Honest member processes (different prompts)."),
    steps: int = typer.Option(24, "--steps", min=1, max=256, help="Greedy tokens each honest member decodes."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Honest members' TPOT and outputs in the shared base pass, alone, calm and during each hostile member's attack."""
    from lorafaas.bench.hostile import run_hostile_bench

    config: LorafaasConfig = ctx.obj
    with RichProgress() as progress:
        result = run_hostile_bench(config.home, backbone, members, steps, progress=progress)
    if as_json:
        print_json(msgspec.to_builtins(result))
        return
    print_table(hostile_table(result))


def hostile_table(result) -> Table:
    """The table of a `HostileBenchResult` (lorafaas/bench/hostile.py)."""
    table = Table("attack", "TPOT", "calm before", "/ calm", "/ alone", f"<= {result.limit:g}x calm",
                  "outputs = alone", "attacker evicted", "honest kept", "attacker CPU", "what the attacker got",
                  title=f"{result.members} honest members, {result.steps} steps on {result.backbone}: TPOT alone "
                        f"{result.tpot_alone_s * 1e3:.1f} ms, calm (median of its runs) "
                        f"{result.tpot_calm_s * 1e3:.1f} ms "
                        f"({result.calm_over_alone:.2f}x, outputs = alone: {result.calm_outputs_equal_alone})")
    for row in result.attacks:
        table.add_row(f"{row.finding} {row.attack}", f"{row.tpot_s * 1e3:.1f} ms", f"{row.calm_tpot_s * 1e3:.1f} ms",
                      f"{row.over_calm:.2f}x", f"{row.over_alone:.2f}x", "yes" if row.within_limit_of_calm else "NO",
                      "yes" if row.outputs_equal_alone else "NO", "yes" if row.attacker_evicted else "no",
                      "yes" if row.honest_kept else "NO", f"{row.attacker_cpu_s / row.attack_s:.0%} of a core",
                      row.outcome)
    return table


app.command("serve")(bench_serve.serve)  # against any OpenAI-compatible server: lorafaas/bench/serve.py
app.command("new-adapter")(bench_serve.new_adapter)  # lorafaas/bench/new_adapter.py
app.command("server-start")(bench_serve.server_start)  # lorafaas/bench/server_start.py
app.command("fleet")(bench_fleet.fleet)  # N functions under a Zipf workload, against vLLM: lorafaas/bench/fleet.py
