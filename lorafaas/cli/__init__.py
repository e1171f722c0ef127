"""The `lorafaas` command line (typer + rich)."""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.markup import escape
from typer.core import TyperGroup

from lorafaas import __version__
from lorafaas.cli import adapter, backbone, bench, demo, functions, invocations, moe, replay, up, usage
from lorafaas.cli.output import err_console
from lorafaas.config import LorafaasConfig
from lorafaas.errors import ClientError, LorafaasError


class _RootGroup(TyperGroup):
    """`lorafaas replay matrix` and `lorafaas replay fleet` are commands of their own beside `lorafaas replay TRACE`
    (a trace file named `matrix` or `fleet` is given as `./matrix`)."""

    def resolve_command(self, ctx, args):
        if args[:2] in (["replay", "matrix"], ["replay", "fleet"]):
            return f"replay {args[1]}", _replay_subcommand(args[1]), args[2:]
        return super().resolve_command(ctx, args)


def _replay_subcommand(name: str):
    sub_app = typer.Typer(add_completion=False)
    sub_app.command(name)(replay.matrix if name == "matrix" else replay.fleet)
    command = typer.main.get_command(sub_app)
    _show_flags_bare(command)
    return command


app = typer.Typer(
    cls=_RootGroup,
    name="lorafaas",
    help="Deploy each LoRA adapter as an isolated serverless function on a shared backbone.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(backbone.app, name="backbone")
app.add_typer(adapter.app, name="adapter")
app.add_typer(bench.app, name="bench")
app.add_typer(moe.app, name="moe")
app.command("demo")(demo.demo)
app.command("up")(up.up)
app.command("deploy")(functions.deploy)
app.command("list")(functions.list_functions)
app.command("ls", help="List functions (alias of list).")(functions.list_functions)
app.command("describe")(functions.describe)
app.command("invoke")(functions.invoke)
app.command("logs")(functions.logs)
app.command("scale")(functions.scale)
app.command("delete")(functions.delete)
app.command("rm", help="Delete a function and stop its instances (alias of delete).")(functions.delete)
app.add_typer(invocations.app, name="invocations")
app.command("usage")(usage.usage)
app.add_typer(functions.keys_app, name="keys")
app.command("replay")(replay.replay)


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"lorafaas {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    ctx: typer.Context,
    home: Path | None = typer.Option(
        None, "--home", help="State directory (default: $LORAFAAS_HOME or ~/.lorafaas).", show_default=False
    ),
    version: bool = typer.Option(False, "--version", callback=_show_version, is_eager=True, help="Show the version."),
) -> None:
    ctx.obj = LorafaasConfig.from_env(home)


def main(argv: list[str] | None = None) -> None:
    """Entry point: user errors exit 2 with a one-line message, lorafaas failures exit 1."""
    # lorafaas never fetches from a model hub; without this, transformers/peft try the network on unknown names.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        command().main(args=argv, prog_name="lorafaas")
    except LorafaasError as exc:
        err_console.print(f"[bold red]error:[/] {escape(exc.message)}")
        raise SystemExit(2 if isinstance(exc, ClientError) else 1) from None


def command():
    """`app` as the click command it runs, with boolean flags shown as bare flags in help (typer labels them
    `<bool>`, which reads as an option that takes a value)."""
    root_command = typer.main.get_command(app)
    _show_flags_bare(root_command)
    return root_command


def _show_flags_bare(cmd) -> None:
    help_option = cmd.get_help_option(cmd.context_class(cmd))  # made (and cached) on first use, like --help's own
    for param in [*cmd.params, *([help_option] if help_option is not None else [])]:
        if getattr(param, "is_flag", False):
            param.metavar = ""
    for sub in getattr(cmd, "commands", {}).values():
        _show_flags_bare(sub)
