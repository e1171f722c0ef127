"""`lorafaas deploy -f FLEET`: many functions from a list file or a directory of adapters, one request per batch."""

from __future__ import annotations

from pathlib import Path

from rich.markup import escape

from lorafaas.cli.function_file import read_adapter_dirs, read_fleet_file
from lorafaas.cli.output import RichProgress, err_console, print_json
from lorafaas.errors import InvalidInput
from lorafaas.platform.api_client import ApiClient
from lorafaas.platform.batch_client import deploy_in_batches


def read_fleet(path: Path, flags: dict) -> list[dict]:
    """The entries to deploy, flags given applied to every one (they win over the file, as for one function)."""
    if flags.get("name") is not None:
        raise InvalidInput(f"{path} deploys many functions, each named in it; leave out NAME")
    specs = read_adapter_dirs(path) if path.is_dir() else read_fleet_file(path)
    given = {k: v for k, v in flags.items() if v is not None}
    return [spec | given for spec in specs]


def deploy_fleet(client: ApiClient, specs: list[dict], batch_size: int, as_json: bool) -> bool:
    """Deploy `specs` in batches of `batch_size` (one request each), progress on stderr; prints what was deployed
    and refused (the index of an entry is its place in the whole fleet). Returns whether every entry was deployed."""
    with RichProgress() as progress:
        progress.stage(f"deploying {len(specs)} functions", total=len(specs))
        outcome = deploy_in_batches(client, specs, batch_size, progress)
    deployed, refused = outcome.deployed, outcome.refused
    if as_json:
        print_json({"deployed": deployed, "refused": refused})
    else:
        err_console.print(f"deployed {len(deployed)} of {len(specs)} functions", highlight=False)
        for entry in refused:
            field = f" ({entry['field']})" if entry.get("field") else ""
            err_console.print(f"[red]refused[/] entry {entry['index']} {escape(entry['name'] or '(no name)')}{field}: "
                              f"{escape(entry['message'])}", highlight=False)
    return not refused
