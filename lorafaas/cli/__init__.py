"""The `lorafaas` command line (typer + rich)."""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Iterable
from pathlib import Path

import typer
from rich.markup import escape
from typer.core import TyperGroup

from lorafaas import __version__
from lorafaas.cli.output import err_console
from lorafaas.config import LorafaasConfig
from lorafaas.errors import ClientError, LorafaasError

# The top-level commands: name -> (module under lorafaas.cli, its Typer group or command function, help if not the
# function's own). `main` imports only the module of the command it runs: a user's `lorafaas list` does not pay for
# importing the benchmarks, the simulator and the server (`bench control-plane` times `list` at 1,000 functions).
COMMANDS: dict[str, tuple[str, str, str | None]] = {
    "backbone": ("backbone", "app", None),
    "adapter": ("adapter", "app", None),
    "bench": ("bench", "app", None),
    "moe": ("moe", "app", None),
    "demo": ("demo", "demo", None),
    "up": ("up", "up", None),
    "deploy": ("functions", "deploy", None),
    "list": ("functions", "list_functions", None),
    "ls": ("functions", "list_functions", "List functions (alias of list)."),
    "describe": ("functions", "describe", None),
    "invoke": ("functions", "invoke", None),
    "logs": ("functions", "logs", None),
    "scale": ("functions", "scale", None),
    "delete": ("functions", "delete", None),
    "rm": ("functions", "delete", "Delete a function and stop its instances (alias of delete)."),
    "invocations": ("invocations", "app", None),
    "usage": ("usage", "usage", None),
    "keys": ("functions", "keys_app", None),
    "replay": ("replay", "replay", None),
}


class _RootGroup(TyperGroup):
    """`lorafaas replay matrix` and `lorafaas replay fleet` are commands of their own beside `lorafaas replay TRACE`
    (a trace file named `matrix` or `fleet` is given as `./matrix`)."""

    def resolve_command(self, ctx, args):
        if args[:2] in (["replay", "matrix"], ["replay", "fleet"]):
            return f"replay {args[1]}", _replay_subcommand(args[1]), args[2:]
        return super().resolve_command(ctx, args)


def _replay_subcommand(name: str):
    from lorafaas.cli import replay

    sub_app = typer.Typer(add_completion=False)
    sub_app.command(name)(replay.matrix if name == "matrix" else replay.fleet)
    command = typer.main.get_command(sub_app)
    _show_flags_bare(command)
    return command


def root_app(names: Iterable[str] = COMMANDS) -> typer.Typer:
    """The `lorafaas` app with the commands `names` (every command by default), importing only their modules."""
    root_typer = typer.Typer(
        cls=_RootGroup,
        name="lorafaas",
        help="Deploy each LoRA adapter as an isolated serverless function on a shared backbone.",
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        add_completion=False,
    )
    for name in names:
        module, attribute, help_text = COMMANDS[name]
        target = getattr(importlib.import_module(f"lorafaas.cli.{module}"), attribute)
        if isinstance(target, typer.Typer):
            root_typer.add_typer(target, name=name)
        else:
            root_typer.command(name, help=help_text)(target)
    root_typer.callback()(root)
    return root_typer


@functools.cache
def _whole_app() -> typer.Typer:
    return root_app()


def __getattr__(name: str) -> typer.Typer:
    """`lorafaas.cli.app`: the whole app, built on first use (tests and docs read it; `main` builds only what runs)."""
    if name == "app":
        return _whole_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"lorafaas {__version__}")
        raise typer.Exit()


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
        command(_command_named(sys.argv[1:] if argv is None else argv)).main(args=argv, prog_name="lorafaas")
    except LorafaasError as exc:
        err_console.print(f"[bold red]error:[/] {escape(exc.message)}")
        raise SystemExit(2 if isinstance(exc, ClientError) else 1) from None


def _command_named(argv: list[str]) -> str | None:
    """The top-level command `argv` runs, past the root's options; None: none known (the whole app answers)."""
    args = iter(argv)
    for arg in args:
        if arg == "--home":
            next(args, None)
        elif not arg.startswith("-"):
            return arg if arg in COMMANDS else None
        elif not arg.startswith("--home="):
            return None  # --help, --version, or an unknown option: the whole app answers
    return None


def command(name: str | None = None):
    """The click command `lorafaas` runs (with only command `name`, or all), with boolean flags shown as bare flags
    in help (typer labels them `<bool>`, which reads as an option that takes a value)."""
    root_command = typer.main.get_command(root_app([name]) if name else root_app())
    _show_flags_bare(root_command)
    return root_command


def _show_flags_bare(cmd) -> None:
    help_option = cmd.get_help_option(cmd.context_class(cmd))  # made (and cached) on first use, like --help's own
    for param in [*cmd.params, *([help_option] if help_option is not None else [])]:
        if getattr(param, "is_flag", False):
            param.metavar = ""
    for sub in getattr(cmd, "commands", {}).values():
        _show_flags_bare(sub)
