"""`lorafaas moe ...`: expert adapters, the LoRA server, and provisioning it (InfiniLoRA)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from lorafaas.cli.output import err_console, human_bytes, print_json, print_table
from lorafaas.config import LorafaasConfig
from lorafaas.errors import InvalidInput
from lorafaas.formats.model_store import ModelStore

app = typer.Typer(help="Mixture-of-experts backbones: expert adapters and the LoRA server.", no_args_is_help=True)


@app.command("provision")
def provision(
    adapters: int = typer.Option(..., "--adapters", min=1, max=100_000, help="Expert adapters deployed (N)."),
    zipf: float = typer.Option(..., "--zipf", min=0.0, max=10.0, help="Zipf exponent of their popularity (s)."),
    instances: int = typer.Option(..., "--instances", min=1, max=100_000, help="Function instances (L)."),
    batch: int = typer.Option(..., "--batch", min=1, max=4096, help="Requests each instance decodes at once (B)."),
    alpha: float = typer.Option(0.95, "--alpha", min=0.01, max=1.0, help="Target immediate admission rate."),
    rank: int = typer.Option(64, "--rank", min=1, max=1024, help="Expert adapters' rank (Mixtral-8x7B shape)."),
    tpot_ms: float = typer.Option(60.0, "--tpot-ms", min=1.0, help="TPOT SLO."),
    base_tpot_ms: float = typer.Option(40.0, "--base-tpot-ms", min=0.1, help="TPOT without LoRA."),
    device_memory_gb: float = typer.Option(72.0, "--device-memory-gb", min=1.0, help="Usable memory per device."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """The LoRA server's minimum adapter cache M*, its memory, and the devices memory and the TPOT budget need."""
    from lorafaas.scheduler.moe_provision import (
        MoeShape,
        ServerDevice,
        TpotBudget,
        min_cache_size,
        plan_devices,
        zipf_popularity,
    )

    if base_tpot_ms >= tpot_ms:
        raise InvalidInput(f"--base-tpot-ms {base_tpot_ms} must be below --tpot-ms {tpot_ms}: no room for LoRA")
    popularity = zipf_popularity(adapters, zipf)
    model = min_cache_size(popularity, instances, batch, alpha)
    shape, device = MoeShape(rank=rank), ServerDevice(memory_bytes=device_memory_gb * 1e9)
    budget = TpotBudget(tpot_slo_s=tpot_ms / 1e3, base_tpot_s=base_tpot_ms / 1e3)
    plan = plan_devices(shape, device, budget, popularity, instances, batch, model.cache_size)
    document = {
        "adapters": adapters,
        "zipf": zipf,
        "instances": instances,
        "batch": batch,
        "alpha": alpha,
        "cache_size": model.cache_size,
        "iar": round(model.iar, 4),
        "tau": round(model.tau, 4),
        "adapter_bytes": shape.adapter_bytes,
        "memory_bytes": model.cache_size * shape.adapter_bytes,
        "memory_devices": plan.memory_devices,
        "tpot_devices": plan.tpot_devices,
        "server_devices": plan.devices,
        "lora_layer_ms": round(plan.lora_layer_s * 1e3, 4),
        "added_tpot_ms": round(plan.added_tpot_s * 1e3, 3),
    }
    if as_json:
        print_json(document)
        return
    table = Table(show_header=False, title=f"LoRA server for {adapters} adapters (Zipf {zipf}), {instances}x{batch}")
    table.add_row("minimum cache M*", f"{model.cache_size} adapters (IAR {model.iar:.3f} >= {alpha})")
    memory = human_bytes(model.cache_size * shape.adapter_bytes)
    table.add_row("memory", f"{memory} ({human_bytes(shape.adapter_bytes)} each)")
    table.add_row("devices for memory", str(plan.memory_devices))
    table.add_row("devices for TPOT", str(plan.tpot_devices) if plan.tpot_devices else "infeasible")
    table.add_row("server devices", str(plan.devices) if plan.devices else "infeasible (the link alone is too slow)")
    print_table(table)


@app.command("create-adapter")
def create_adapter(
    ctx: typer.Context,
    out: Path = typer.Argument(..., help="Output directory (created)."),
    backbone: str = typer.Option(..., "--backbone", help="An MoE backbone in the model store."),
    rank: int = typer.Option(8, "--rank", min=1, max=1024),
    alpha: int = typer.Option(16, "--alpha", min=1),
    seed: int = typer.Option(0, "--seed"),
    attention: str = typer.Option("q_proj,v_proj", "--attention", help="Attention projections, comma-separated."),
    as_json: bool = typer.Option(False, "--json", help="Print the adapter's summary."),
) -> None:
    """Write a random expert adapter (every expert of every MoE layer) for a backbone: for tests and benchmarks."""
    from lorafaas.formats.expert_adapters import read_expert_adapter_info, write_expert_adapter

    config: LorafaasConfig = ctx.obj
    store = ModelStore(config.models_dir)
    if out.exists() and any(out.iterdir()):
        raise InvalidInput(f"{out} exists and is not empty")
    modules = tuple(a.strip() for a in attention.split(",") if a.strip())
    write_expert_adapter(
        out,
        store.path(store.get(backbone).name),
        rank=rank,
        alpha=alpha,
        seed=seed,
        attention_modules=modules,
        base_model_name=backbone,
    )
    info = read_expert_adapter_info(out)
    if as_json:
        print_json(info.summary())
        return
    err_console.print(
        f"wrote an expert adapter for {backbone!r} at {out}: {human_bytes(info.expert_bytes)} of "
        f"expert factors, {human_bytes(info.attention_bytes)} of attention factors"
    )


@app.command("validate")
def validate(
    ctx: typer.Context,
    path: Path = typer.Argument(..., help="Expert adapter directory."),
    backbone: str = typer.Option(..., "--backbone", help="MoE backbone in the model store."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Check an expert adapter against an MoE backbone; exit 2 with the reason if it does not fit."""
    from lorafaas.models.adapter_validation import validate_expert_adapter

    config: LorafaasConfig = ctx.obj
    info = validate_expert_adapter(path, ModelStore(config.models_dir), backbone)
    summary = {**info.summary(), "backbone": backbone, "valid": True}
    if as_json:
        print_json(summary)
        return
    err_console.print(f"[green]ok:[/] {path} fits backbone {backbone!r}")
    table = Table(show_header=False)
    for key, value in summary.items():
        table.add_row(key, human_bytes(value) if key.endswith("bytes") else str(value))
    print_table(table)


@app.command("serve")
def serve(
    ctx: typer.Context,
    backbone: str = typer.Argument(..., help="MoE backbone in the model store."),
    socket_path: Path = typer.Option(None, "--socket", help="Unix socket (default: $LORAFAAS_HOME/run/NAME.lora)."),
    tcp: str = typer.Option(None, "--tcp", help="HOST:PORT for instances on other nodes."),
    capacity: int = typer.Option(8, "--capacity", min=1, help="Adapters resident at once (M)."),
    threads: int = typer.Option(1, "--threads", min=1, help="Compute threads."),
) -> None:
    """Run a LoRA server for a backbone in the foreground (what the node agent starts per MoE backbone)."""
    from lorafaas.lora_server.server import LoraServerConfig
    from lorafaas.lora_server.server import serve as serve_lora

    config: LorafaasConfig = ctx.obj
    store = ModelStore(config.models_dir)
    model_dir = store.path(store.get(backbone).name)
    socket_path = socket_path or config.home / "run" / f"{backbone}.lora"
    server_config = LoraServerConfig(
        model_dir=model_dir, socket_path=socket_path, tcp=tcp, capacity=capacity, num_threads=threads
    )
    serve_lora(server_config, on_ready=lambda addresses: err_console.print(f"LoRA server serving {addresses}"))
