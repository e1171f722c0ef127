"""`lorafaas invocations get|list|wait|cancel`: asynchronous invocations (`lorafaas invoke --async`) by id."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import typer
from rich.table import Table

from lorafaas.cli.functions import JSON, URL, client_for
from lorafaas.cli.output import err_console, print_json, print_table, print_text

# `wait`'s exit codes besides 0 (succeeded), 1 (lorafaas failed) and 2 (bad input): as GNU timeout(1) on a timeout.
EXIT_INVOCATION_FAILED = 1
EXIT_TIMED_OUT = 124
POLL_FIRST_S, POLL_MAX_S = 0.1, 1.0
STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
TERMINAL = ("succeeded", "failed", "cancelled")

app = typer.Typer(help="Asynchronous invocations (`lorafaas invoke --async`): get, list, wait, cancel.",
                  no_args_is_help=True)


@app.command("get")
def get(ctx: typer.Context, invocation_id: str, url: str | None = URL, as_json: bool = JSON) -> None:
    """Show an invocation: its status, and its result or error once it ended (kept one hour)."""
    with client_for(ctx, url) as client:
        _show(client.invocation(invocation_id), as_json)


@app.command("list")
def list_invocations(
    ctx: typer.Context,
    function: str | None = typer.Option(None, "--function", help="Only this function's invocations."),
    status: str | None = typer.Option(None, "--status", help=f"Only invocations in this status: "
                                                             f"{', '.join(STATUSES)}."),
    limit: int = typer.Option(100, "--limit", min=1, max=1000, help="At most this many, newest first."),
    url: str | None = URL,
    as_json: bool = JSON,
) -> None:
    """List your invocations of the last hour, newest first."""
    with client_for(ctx, url) as client:
        records = client.invocations(function, status, limit)
    if as_json:
        print_json(records)
        return
    table = Table("invocation", "function", "status", "created", "tokens (prompt/completion)")
    for r in records:
        table.add_row(r["invocation_id"], r["function"], r["status"], _when(r["created_at"]),
                      f"{r['prompt_tokens']}/{r['completion_tokens']}" if r["status"] == "succeeded" else "")
    print_table(table)


@app.command("wait")
def wait(
    ctx: typer.Context,
    invocation_id: str,
    timeout: float = typer.Option(600.0, "--timeout", min=0.0, help="Seconds to wait for the end; past them "
                                                                       f"exit {EXIT_TIMED_OUT}."),
    url: str | None = URL,
    as_json: bool = JSON,
) -> None:
    """Wait for an invocation to end and print its result. Exit 0 if it succeeded, 1 if it failed, 124 if it is still
    queued or running after --timeout."""
    deadline = time.monotonic() + timeout
    pause_s = POLL_FIRST_S
    with client_for(ctx, url) as client:
        while (record := client.invocation(invocation_id))["status"] not in TERMINAL:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                if as_json:
                    print_json(record)
                err_console.print(f"[bold red]error:[/] invocation {invocation_id} is still {record['status']} "
                                  f"after {timeout:g} s (--timeout)")
                raise typer.Exit(EXIT_TIMED_OUT)
            time.sleep(min(pause_s, left_s))
            pause_s = min(pause_s * 2, POLL_MAX_S)
    if as_json:
        print_json(record)
    elif record["status"] == "succeeded":
        print_text(record["result_text"])
    if record["status"] != "succeeded":
        err_console.print(f"[bold red]error:[/] invocation {invocation_id} {record['status']}: "
                          f"{record.get('error_code') or ''} {record.get('error_message') or ''}".rstrip())
        raise typer.Exit(EXIT_INVOCATION_FAILED)


@app.command("cancel")
def cancel(ctx: typer.Context, invocation_id: str, url: str | None = URL, as_json: bool = JSON) -> None:
    """Cancel one of your queued or running invocations: its generation stops and it ends `cancelled` (exit 2 if it
    does not exist or already ended)."""
    with client_for(ctx, url) as client:
        _show(client.cancel_invocation(invocation_id), as_json)


def _show(record: dict, as_json: bool) -> None:
    """An invocation record: its JSON, or its summary on stderr and, once it succeeded, its text on stdout."""
    if as_json:
        print_json(record)
        return
    err_console.print(_summary(record), markup=False, highlight=False)
    if record["status"] == "succeeded":
        print_text(record["result_text"])


def _summary(record: dict) -> str:
    line = f"{record['invocation_id']}: {record['function']}, {record['status']}, created {_when(record['created_at'])}"
    if record["status"] == "succeeded":
        line += (f", {record['prompt_tokens']} prompt + {record['completion_tokens']} completion tokens, finish "
                 f"{record['finish_reason']}")
    elif record["status"] in ("failed", "cancelled"):
        line += f": {record.get('error_code')}: {record.get('error_message')}"
    return line


def _when(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
