"""Commands that talk to a running platform: deploy, list, describe, invoke, logs, scale, delete, keys."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path

import typer
import yaml
from rich.table import Table

from lorafaas.cli.output import console, err_console, print_json
from lorafaas.config import LorafaasConfig
from lorafaas.errors import InvalidInput
from lorafaas.platform.api_client import DEFAULT_URL, ApiClient, resolve_key

URL = typer.Option(DEFAULT_URL, "--url", envvar="LORAFAAS_URL", help="The lorafaas gateway.")
JSON = typer.Option(False, "--json", help="Print one JSON document.")
YAML_FIELDS = {"name", "adapter", "backbone", "slo_ttft_ms", "keep_alive_s", "min_instances", "max_instances",
               "max_tokens_limit", "max_request_s", "lora_mode", "tenant"}


def _client(ctx: typer.Context, url: str) -> ApiClient:
    config: LorafaasConfig = ctx.obj
    return ApiClient(url, resolve_key(config))


def deploy(
    ctx: typer.Context,
    name: str | None = typer.Argument(None, help="Function name (or give -f)."),
    adapter: Path | None = typer.Option(None, "--adapter", help="PEFT LoRA adapter directory."),
    backbone: str | None = typer.Option(None, "--backbone", help="Backbone in the platform's model store."),
    slo_ttft_ms: int | None = typer.Option(None, "--slo-ttft-ms", help="Time-to-first-token SLO."),
    keep_alive_s: float | None = typer.Option(None, "--keep-alive", help="Seconds an idle instance is kept."),
    min_instances: int | None = typer.Option(None, "--min", help="Instances kept ready at all times."),
    max_instances: int | None = typer.Option(None, "--max", help="Upper bound on instances."),
    max_tokens_limit: int | None = typer.Option(None, "--max-tokens-limit", help="Most tokens one request may ask."),
    max_request_s: float | None = typer.Option(
        None, "--max-request-s", help="Wall-time limit of one request, queueing included (504 beyond)."
    ),
    lora_mode: str | None = typer.Option(
        None, "--lora-mode", help="MoE backbones: remote (default: the node's LoRA server runs the experts' LoRA) "
        "or local (each instance holds its expert adapter)."
    ),
    tenant: str | None = typer.Option(None, "--tenant", help="Deploy for this tenant (admin key only)."),
    file: Path | None = typer.Option(None, "-f", "--file", help="function.yaml with the same fields."),
    replace: bool = typer.Option(False, "--replace", help="Update an existing function (atomic switch)."),
    url: str = URL,
    as_json: bool = JSON,
) -> None:
    """Deploy a LoRA adapter as a function."""
    spec = _read_function_file(file) if file else {}
    flags = {"name": name, "backbone": backbone, "slo_ttft_ms": slo_ttft_ms, "keep_alive_s": keep_alive_s,
             "min_instances": min_instances, "max_instances": max_instances, "max_tokens_limit": max_tokens_limit,
             "max_request_s": max_request_s, "lora_mode": lora_mode, "tenant": tenant}
    spec |= {k: v for k, v in flags.items() if v is not None}
    adapter_dir = adapter or (Path(spec.pop("adapter")) if "adapter" in spec else None)
    spec.pop("adapter", None)
    if not spec.get("name"):
        raise InvalidInput("give the function's name (NAME or `name:` in -f)")
    with _client(ctx, url) as client:
        if replace:
            fn = spec.pop("name")
            spec.pop("backbone", None)
            result = client.update(fn, spec, adapter_dir)
        else:
            if adapter_dir is None or not spec.get("backbone"):
                raise InvalidInput("deploy needs --adapter PATH and --backbone NAME (or `adapter:` and `backbone:`)")
            result = client.deploy(spec, adapter_dir)
    if as_json:
        print_json(result)
    else:
        err_console.print(f"deployed [bold]{result['name']}[/] version {result['version']} on {result['backbone']} "
                          f"(adapter {result['adapter_digest'][:12]}); call it with `lorafaas invoke {result['name']} "
                          "\"...\"`")


def _read_function_file(path: Path) -> dict:
    try:
        document = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidInput(f"cannot read {path}: {exc}") from exc
    if not isinstance(document, dict):
        raise InvalidInput(f"{path} must be a YAML mapping of function fields")
    unknown = set(document) - YAML_FIELDS
    if unknown:
        raise InvalidInput(f"{path}: unknown field(s) {', '.join(sorted(unknown))}; known: "
                           f"{', '.join(sorted(YAML_FIELDS))}")
    if "adapter" in document:  # relative to the YAML file
        document["adapter"] = str((path.parent / document["adapter"]).resolve())
    return document


def list_functions(ctx: typer.Context, url: str = URL, as_json: bool = JSON) -> None:
    """List functions."""
    with _client(ctx, url) as client:
        functions = client.list()
    if as_json:
        print_json(functions)
        return
    table = Table("name", "tenant", "backbone", "adapter", "version", "SLO TTFT", "keep-alive", "min/max")
    for f in functions:
        bounds = f"{f['min_instances']}/{f['max_instances']}"
        table.add_row(f["name"], f["tenant"], f["backbone"], f["adapter_digest"][:12], str(f["version"]),
                      f"{f['slo_ttft_ms']} ms", f"{f['keep_alive_s']:g} s", bounds)
    console.print(table)


def describe(ctx: typer.Context, name: str, url: str = URL, as_json: bool = JSON) -> None:
    """Show a function's spec, its instances (pid, device, state) and its last cold start."""
    with _client(ctx, url) as client:
        info = client.describe(name)
    if as_json:
        print_json(info)
        return
    spec = info["function"]
    console.print(f"[bold]{spec['name']}[/] (tenant {spec['tenant']}) version {spec['version']}: backbone "
                  f"{spec['backbone']}, adapter {spec['adapter_digest'][:12]}, SLO {spec['slo_ttft_ms']} ms, "
                  f"keep-alive {spec['keep_alive_s']:g} s, instances {spec['min_instances']}..{spec['max_instances']}"
                  + (f", LoRA mode {spec['lora_mode']}" if spec.get("lora_mode") else ""))
    table = Table("instance", "pid", "device", "state", "in flight", "adapter", "cold start")
    for i in info["instances"]:
        table.add_row(i["instance_id"], str(i["pid"]), i["device"], i["state"], str(i["in_flight"]),
                      _adapter(i.get("adapter")), _breakdown(i["cold_start"]))
    console.print(table)
    if info.get("last_cold_start"):
        console.print(f"last cold start: {_breakdown(info['last_cold_start'])}")
    if batching := info.get("batching"):
        console.print(f"batching: up to {batching['max_batch_size']} requests per instance, prefill T(b) = "
                      f"{batching['prefill_t0_s'] * 1e3:.0f} ms + {batching['prefill_per_request_s'] * 1e3:.0f} ms x "
                      f"(b - 1) from {batching['prefills_observed']} prefills; most in flight "
                      f"{batching['most_in_flight']}")
    for item in info.get("offloaded") or []:
        console.print(f"offloaded: {_offloaded(item)}")
    for failure in info.get("failures") or []:
        console.print(f"[red]failed:[/] {failure['instance_id']}: {failure['reason']} {failure.get('message', '')}")


def _adapter(adapter: dict | None) -> str:
    """E.g. `experts, remote: 7.0 KiB held (64.0 KiB of experts on the LoRA server)`."""
    if not adapter:
        return ""
    held = f"{adapter['held_bytes'] / 1024:.1f} KiB held"
    if adapter["kind"] == "dense":
        return f"dense: {held}"
    where = "on the LoRA server" if adapter["lora_mode"] == "remote" else "here"
    return f"experts, {adapter['lora_mode']}: {held} ({adapter['expert_bytes'] / 1024:.1f} KiB of experts {where})"


def _offloaded(item: dict) -> str:
    return f"{item['kind']} {item['from']} -> {item['to']} ({item['reason']})"


def _breakdown(steps: dict) -> str:
    return ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in steps.items())


def invoke(
    ctx: typer.Context,
    name: str,
    prompt: str,
    stream: bool = typer.Option(False, "--stream", help="Print tokens as they arrive."),
    max_tokens: int = typer.Option(128, "--max-tokens", help="Upper bound on generated tokens."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 is greedy."),
    raw: bool = typer.Option(False, "--raw", help="Send PROMPT as plain text, without the chat template."),
    run_async: bool = typer.Option(False, "--async", help="Return an invocation id at once; poll it to the end."),
    url: str = URL,
    as_json: bool = JSON,
) -> None:
    """Call a function."""
    body = {"max_tokens": max_tokens, "temperature": temperature}
    body |= {"prompt": prompt} if raw else {"messages": [{"role": "user", "content": prompt}]}
    with _client(ctx, url) as client:
        if run_async:
            accepted = client.invoke_async(name, body)
            err_console.print(f"accepted as {accepted['invocation_id']}; waiting for the result")
            while (record := client.invocation(accepted["invocation_id"]))["status"] in ("queued", "running"):
                time.sleep(0.2)
            if as_json:
                print_json(record)
            else:
                console.print(record["result_text"] if record["status"] == "succeeded"
                              else f"[red]{record['status']}:[/] {record['error_message']}")
            return
        if stream:
            for event in client.invoke_stream(name, body):
                if event["type"] == "token":
                    console.print(event["text"], end="", soft_wrap=True, markup=False, highlight=False)
            console.print()
            return
        result = client.invoke(name, body)
    if as_json:
        print_json(result)
    else:
        console.print(result["text"], markup=False, highlight=False)


def logs(ctx: typer.Context, name: str, url: str = URL) -> None:
    """Print the logs of a function's instances."""
    with _client(ctx, url) as client:
        console.print(client.logs(name), markup=False, highlight=False)


def scale(
    ctx: typer.Context,
    name: str,
    min_instances: int | None = typer.Option(None, "--min"),
    max_instances: int | None = typer.Option(None, "--max"),
    url: str = URL,
) -> None:
    """Set a function's minimum and maximum number of instances."""
    changes = {k: v for k, v in {"min_instances": min_instances, "max_instances": max_instances}.items()
               if v is not None}
    if not changes:
        raise InvalidInput("give --min and/or --max")
    with _client(ctx, url) as client:
        spec = client.update(name, changes)
    err_console.print(f"{name}: instances {spec['min_instances']}..{spec['max_instances']}")


def delete(ctx: typer.Context, name: str, url: str = URL) -> None:
    """Delete a function and stop its instances."""
    with _client(ctx, url) as client:
        client.delete(name)
    err_console.print(f"deleted {name}")


keys_app = typer.Typer(help="API keys (admin key only).", no_args_is_help=True)


@keys_app.command("create")
def create_key(ctx: typer.Context, tenant: str, url: str = URL, as_json: bool = JSON) -> None:
    """Make an API key for TENANT; it is printed once and stored only hashed."""
    with _client(ctx, url) as client:
        created = client.create_key(tenant)
    if as_json:
        print_json(created)
    else:
        err_console.print(f"key {created['key_id']} for tenant {tenant} (shown once, keep it safe):")
        console.print(created["key"], markup=False)


@keys_app.command("list")
def list_keys(ctx: typer.Context, url: str = URL, as_json: bool = JSON) -> None:
    """List API keys (ids and tenants; never the keys)."""
    with _client(ctx, url) as client:
        keys = client.list_keys()
    if as_json:
        print_json(keys)
        return
    table = Table("key id", "tenant", "admin", "created", "last used")
    for k in keys:
        table.add_row(k["key_id"], k["tenant"], "yes" if k["is_admin"] else "", _when(k.get("created_at")),
                      _when(k.get("last_used_at")) or "never")
    console.print(table)


@keys_app.command("revoke")
def revoke_key(ctx: typer.Context, key_id: str, url: str = URL) -> None:
    """Revoke the key KEY_ID (see `keys list`): requests with it get 401 from now on."""
    with _client(ctx, url) as client:
        revoked = client.revoke_key(key_id)
    err_console.print(f"revoked key {revoked['revoked']} of tenant {revoked['tenant']}")


def _when(timestamp: float | None) -> str:
    if timestamp is None:
        return ""
    return datetime.fromtimestamp(timestamp, tz=UTC).strftime("%Y-%m-%d %H:%M UTC")
