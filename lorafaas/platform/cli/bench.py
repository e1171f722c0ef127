"""`lorafaas bench ...`: measurements printed as one JSON document (`--json`) or a table."""

from __future__ import annotations

import msgspec
import typer
from rich.table import Table

from lorafaas.config import LorafaasConfig
from lorafaas.platform.cli.output import RichProgress, console, human_bytes, print_json

app = typer.Typer(help="Benchmarks of the platform's mechanisms.", no_args_is_help=True)


@app.command("attach")
def attach(
    ctx: typer.Context,
    backbone: str = typer.Option("smollm2-135m", "--backbone", help="A backbone in the model store."),
    repeats: int = typer.Option(5, "--repeats", min=1, max=50, help="Fresh processes of each kind (median)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Private from_pretrained vs attaching to the shared backbone (lease, map, empty model, bind), fresh processes."""
    from lorafaas.backbone_daemon.bench import run_attach_bench

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
    console.print(table)
