"""`lorafaas usage`: what a tenant's invocations were charged (the caller's tenant; every tenant's with the admin
key), summed per function or tenant."""

from __future__ import annotations

import typer

from lorafaas.cli.functions import JSON, URL, client_for
from lorafaas.cli.output import print_json

COLUMNS = (("invocations", "INVOCATIONS", "{}"), ("cold_starts", "COLD", "{}"), ("prompt_tokens", "PROMPT", "{}"),
           ("completion_tokens", "COMPLETION", "{}"), ("device_s", "DEVICE-S", "{:.4f}"),
           ("memory_gb_s", "MEMORY-GB-S", "{:.4f}"))


def usage(
    ctx: typer.Context,
    since: str | None = typer.Option(None, "--since", help="From this time: unix seconds or ISO 8601 (UTC if no "
                                     "zone), e.g. 2026-11-24T07:00:00Z.", show_default=False),
    until: str | None = typer.Option(None, "--until", help="Before this time (same forms).", show_default=False),
    group_by: str = typer.Option("function", "--group-by", help="Sum per function or per tenant."),
    url: str = URL,
    as_json: bool = JSON,
) -> None:
    """Show usage: invocations, tokens, device-seconds and memory GB-seconds charged."""
    with client_for(ctx, url) as client:
        summary = client.usage(since, until, group_by)
    if as_json:
        print_json(summary)
        return
    keys = ("tenant", "function") if summary["group_by"] == "function" else ("tenant",)
    header = [k.upper() for k in keys] + [title for _, title, _ in COLUMNS]
    rows = [[str(g[k]) for k in keys] + [fmt.format(g[name]) for name, _, fmt in COLUMNS] for g in summary["groups"]]
    rows.append(["TOTAL"] + [""] * (len(keys) - 1) + [fmt.format(summary["total"][name]) for name, _, fmt in COLUMNS])
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        typer.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
