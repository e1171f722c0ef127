"""`lorafaas backbone ...`: import and list backbones in the model store; serve one to functions."""

from __future__ import annotations

from pathlib import Path

import msgspec
import typer
from rich.table import Table

from lorafaas.cli.output import RichProgress, err_console, human_bytes, print_json, print_table
from lorafaas.config import LorafaasConfig
from lorafaas.formats.model_store import ModelStore

app = typer.Typer(help="Import, list and serve backbones (base models).", no_args_is_help=True)


@app.command("import")
def import_backbone(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Store name; without --from, a built-in backbone (smollm2-135m)."),
    from_dir: Path | None = typer.Option(
        None, "--from", help="A local Hugging Face causal-LM directory with safetensors weights."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the stored manifest, `created` and `path`."),
) -> None:
    """Import a backbone into the model store (a second import of the same weights is a no-op)."""
    from lorafaas.platform.builtin_backbones import import_builtin

    config: LorafaasConfig = ctx.obj
    store = ModelStore(config.models_dir)
    with RichProgress() as progress:
        if from_dir is None:
            manifest, created = import_builtin(store, name, progress)
        else:
            manifest, created = store.import_dir(name, from_dir, progress)
    if as_json:
        print_json({**msgspec.to_builtins(manifest), "created": created, "path": str(store.path(name))})
        return
    verb = "imported" if created else "already imported"
    err_console.print(
        f"{verb} [bold]{manifest.name}[/] ({manifest.architecture}, {manifest.num_parameters / 1e6:.1f}M parameters, "
        f"{human_bytes(manifest.bytes)}, sha256 {manifest.short_hash}) at {store.path(name)}"
    )


@app.command("convert")
def convert(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Store name of the copy."),
    source: str = typer.Option(..., "--from", help="The stored backbone to copy."),
    dtype: str = typer.Option(..., "--dtype", help="bfloat16, float16 or float32."),
    as_json: bool = typer.Option(False, "--json", help="Print the stored manifest, `created` and `path`."),
) -> None:
    """Store a backbone in another dtype (its adapters deploy on the copy). bfloat16 halves the bytes a decode step
    reads: on a CPU with AVX-512 BF16, batches of 8 decode about twice as fast, one row no faster
    (docs/performance.md)."""
    from lorafaas.formats.backbone_dtype import convert_backbone

    config: LorafaasConfig = ctx.obj
    store = ModelStore(config.models_dir)
    with RichProgress() as progress:
        manifest, created = convert_backbone(store, name, source, dtype, progress)
    if as_json:
        print_json({**msgspec.to_builtins(manifest), "created": created, "path": str(store.path(name))})
        return
    verb = "converted" if created else "already converted"
    err_console.print(f"{verb} [bold]{source}[/] to {dtype} as [bold]{manifest.name}[/] "
                      f"({human_bytes(manifest.bytes)}, sha256 {manifest.short_hash}); "
                      f"deploy on it with `--backbone {manifest.name}`")


@app.command("list")
def list_backbones(ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List the backbones in the model store."""
    config: LorafaasConfig = ctx.obj
    manifests = ModelStore(config.models_dir).list()
    if as_json:
        print_json([msgspec.to_builtins(m) for m in manifests])
        return
    if not manifests:
        err_console.print("no backbones yet; import the default with `lorafaas backbone import smollm2-135m`")
        return
    table = Table("name", "architecture", "parameters", "bytes", "dtypes", "sha256")
    for m in manifests:
        table.add_row(m.name, m.architecture, f"{m.num_parameters / 1e6:.1f}M", human_bytes(m.bytes),
                      ",".join(m.dtypes), m.short_hash)
    print_table(table)


@app.command("serve")
def serve(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="A backbone in the model store."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda:N."),
    lease_ttl: float | None = typer.Option(
        None, "--lease-ttl", help="Reap leases not renewed by a heartbeat within this many seconds.", show_default=False
    ),
) -> None:
    """Run the backbone daemon in the foreground: load NAME once onto DEVICE and lease it read-only to functions.

    Prints the socket path on stdout once it serves; Ctrl-C or SIGTERM stops it and removes its segment.
    """
    import logging

    from rich.logging import RichHandler

    from lorafaas.backbone_daemon.server import serve as serve_daemon
    from lorafaas.protocols.daemon_config import DaemonConfig

    config: LorafaasConfig = ctx.obj
    logging.basicConfig(level=logging.INFO, format="%(message)s",
                        handlers=[RichHandler(console=err_console, show_path=False)])
    daemon_config = DaemonConfig(home=config.home, backbone=name, device=device, lease_ttl_s=lease_ttl)

    def ready(paths) -> None:
        print(paths.socket, flush=True)

    serve_daemon(daemon_config, on_ready=ready)


@app.command("hold")
def hold(
    ctx: typer.Context,
    names: list[str] = typer.Argument(..., help="The backbones whose daemons this node runs."),
    device: str = typer.Option("cpu", "--device", help="Their device: cpu (a GPU daemon's segment is not held)."),
    port: int | None = typer.Option(None, "--port", help="Answer liveness probes on this TCP port.",
                                    show_default=False),
) -> None:
    """Hold each backbone daemon's segment, so that a daemon restarted after a crash maps the same copy.

    The node agent's companion on Kubernetes (the kubelet restarts the daemons); runs until SIGTERM.
    """
    import logging
    import signal

    from rich.logging import RichHandler

    from lorafaas.backbone_daemon.segment_holder import SegmentHolder
    from lorafaas.protocols.daemon_config import DaemonConfig

    config: LorafaasConfig = ctx.obj
    if port is not None and not 0 < port < 65536:
        raise typer.BadParameter(f"port is {port}; it must lie between 1 and 65535", param_hint="--port")
    logging.basicConfig(level=logging.INFO, format="%(message)s",
                        handlers=[RichHandler(console=err_console, show_path=False)])
    holder = SegmentHolder([DaemonConfig(home=config.home, backbone=name, device=device) for name in names],
                           port=port)
    signal.signal(signal.SIGTERM, lambda *_: holder.stop())
    try:
        holder.serve()
    except KeyboardInterrupt:
        pass
    finally:
        holder.stop()
