"""`lorafaas adapter ...`: inspect, validate and train PEFT LoRA adapters."""

from __future__ import annotations

import math
from pathlib import Path

import typer
from rich.table import Table

from lorafaas.cli.output import RichProgress, err_console, human_bytes, print_json, print_table
from lorafaas.config import LorafaasConfig
from lorafaas.formats.adapter_files import AdapterInfo, read_adapter
from lorafaas.formats.model_store import ModelStore

app = typer.Typer(help="Inspect, validate and train LoRA adapters.", no_args_is_help=True)


def _show(info: AdapterInfo, as_json: bool, extra: dict | None = None) -> None:
    summary = {**info.summary(), **_scaling(info), **(extra or {})}
    if as_json:
        print_json(summary)
        return
    table = Table(show_header=False)
    for key, value in summary.items():
        if key == "scaling_overrides" and not value:
            continue
        if key == "bytes":
            shown = human_bytes(value)
        elif isinstance(value, list):
            shown = ", ".join(value)
        elif isinstance(value, dict):
            shown = ", ".join(f"{k}: {v:g}" for k, v in value.items())
        else:
            shown = f"{value:g}" if isinstance(value, float) else value
        table.add_row(key, str(shown))
    print_table(table)


def _scaling(info: AdapterInfo) -> dict:
    """What PEFT multiplies a module's LoRA output by: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA; and the
    modules whose rank_pattern / alpha_pattern give them another scaling."""
    use_rslora = bool(info.config.get("use_rslora"))
    scaling = info.alpha / math.sqrt(info.rank) if use_rslora else info.alpha / info.rank
    overrides = {module: entry.scaling for module, entry in info.layout.loras.items()
                 if not math.isclose(entry.scaling, scaling)}
    return {"use_rslora": use_rslora, "scaling": scaling, "scaling_overrides": overrides}


@app.command("inspect")
def inspect(
    path: Path = typer.Argument(..., help="Adapter directory (adapter_config.json + adapter_model.safetensors)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Show an adapter's base model, rank, alpha, rsLoRA and the effective scaling, target modules and size."""
    _show(read_adapter(path), as_json)


@app.command("validate")
def validate(
    ctx: typer.Context,
    path: Path = typer.Argument(..., help="Adapter directory."),
    backbone: str = typer.Option(..., "--backbone", help="Backbone in the model store to check against."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Check that an adapter can run on a backbone; exit 2 with the reason if not."""
    from lorafaas.models.adapter_validation import validate_adapter

    config: LorafaasConfig = ctx.obj
    info = validate_adapter(path, ModelStore(config.models_dir), backbone)
    if not as_json:
        err_console.print(f"[green]ok:[/] {path} fits backbone {backbone!r}")
    _show(info, as_json, {"backbone": backbone, "valid": True})


@app.command("train")
def train(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Adapter name (the default output directory is adapters/NAME)."),
    backbone: str = typer.Option(..., "--backbone", help="Backbone in the model store."),
    data: Path = typer.Option(..., "--data", help='JSONL: {"prompt", "response"} or {"messages"} per line.'),
    rank: int = typer.Option(8, "--rank", help="LoRA rank."),
    alpha: int | None = typer.Option(None, "--alpha", help="LoRA alpha (default: 2 x rank)."),
    steps: int = typer.Option(200, "--steps", help="Optimizer steps."),
    batch_size: int = typer.Option(4, "--batch-size"),
    learning_rate: float = typer.Option(1e-3, "--lr"),
    seed: int = typer.Option(0, "--seed"),
    target_modules: str = typer.Option("q_proj,k_proj,v_proj,o_proj", "--target-modules", help="Comma-separated."),
    out: Path | None = typer.Option(None, "--out", help="Output directory (must be empty or absent)."),
    as_json: bool = typer.Option(False, "--json", help="Print the adapter's summary and the losses."),
) -> None:
    """Fine-tune a LoRA adapter with PEFT on the CPU."""
    from lorafaas.formats.model_store import check_name
    from lorafaas.models.train import TrainConfig, train_adapter

    config: LorafaasConfig = ctx.obj
    check_name(name, "adapter")
    train_config = TrainConfig(
        rank=rank, alpha=alpha or 2 * rank, steps=steps, batch_size=batch_size, learning_rate=learning_rate,
        seed=seed, target_modules=tuple(t.strip() for t in target_modules.split(",") if t.strip()),
    )
    out_dir = out or Path("adapters") / name
    with RichProgress() as progress:
        result = train_adapter(ModelStore(config.models_dir), backbone, data, out_dir, train_config, progress)
    info = read_adapter(out_dir)
    if as_json:
        _show(info, True, {"first_loss": result.first_loss, "final_loss": result.final_loss,
                           "seconds": result.seconds})
        return
    err_console.print(
        f"trained [bold]{name}[/] in {result.seconds:.0f} s: loss {result.first_loss:.3f} -> {result.final_loss:.3f}; "
        f"{human_bytes(info.num_bytes)} at {out_dir}"
    )
