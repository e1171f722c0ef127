"""Commands that talk to a running platform: deploy, list, describe, invoke, logs, scale, delete, keys."""

from __future__ import annotations

import re
import shlex
import sys
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import typer
from rich.markup import escape
from rich.table import Table

from lorafaas.cli.output import (
    console,
    err_console,
    print_columns,
    print_json,
    print_json_line,
    print_table,
    print_text,
)
from lorafaas.config import LorafaasConfig
from lorafaas.errors import FunctionNotFound, InvalidInput
from lorafaas.platform import log_lines
from lorafaas.platform.api_client import ApiClient, resolve_key, resolve_url
from lorafaas.platform.batches import DEFAULT_BATCH_SIZE

URL = typer.Option(None, "--url", envvar="LORAFAAS_URL", show_default=False,
                   help="The lorafaas gateway (default: $LORAFAAS_URL, else the URL `lorafaas up` recorded in the "
                        "home, else http://127.0.0.1:8080).")
JSON = typer.Option(False, "--json", help="Print one JSON document.")
FOLLOW_POLL_S = 1.0
SECONDS_PER = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def client_for(ctx: typer.Context, url: str | None) -> ApiClient:
    config: LorafaasConfig = ctx.obj
    return ApiClient(resolve_url(config, url), resolve_key(config))


def hint(ctx: typer.Context, url: str | None, command: str) -> str:
    """`lorafaas COMMAND` as a printed hint, with the options it needs to reach the same platform from the same shell:
    --home if it was given, --url if it was given on the command line (an environment variable or the URL recorded
    in the home still hold there)."""
    home = f" --home {shlex.quote(str(ctx.obj.home))}" if ctx.find_root().params.get("home") is not None else ""
    source = ctx.get_parameter_source("url")  # typer's own copy of click's ParameterSource: compared by name
    given_url = source is not None and source.name == "COMMANDLINE"
    return f"lorafaas{home} {command}" + (f" --url {shlex.quote(url)}" if url and given_url else "")


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
    shared_base: bool | None = typer.Option(
        None, "--shared-base/--no-shared-base", help="Whether its steps may join the node's shared base pass (the "
        "default; a CPU node runs one unless `up --no-shared-base`); --no-shared-base keeps every backbone product in "
        "its own process."
    ),
    tenant: str | None = typer.Option(None, "--tenant", help="Deploy for this tenant (admin key only)."),
    file: Path | None = typer.Option(
        None, "-f", "--file", help="function.yaml: keys spelled as these flags (keep-alive: 60), see "
        "examples/function.yaml; flags given too win. A list of such entries (YAML or JSON, examples/fleet.yaml) or "
        "a directory of adapter directories (each a function named after it) deploys them all."
    ),
    batch_size: int = typer.Option(DEFAULT_BATCH_SIZE, "--batch-size", help="With a fleet: functions per request."),
    replace: bool = typer.Option(False, "--replace", help="Update an existing function (atomic switch)."),
    url: str | None = URL,
    as_json: bool = JSON,
) -> None:
    """Deploy a LoRA adapter as a function (or, with -f, a fleet of them)."""
    from lorafaas.cli.fleet import deploy_fleet, read_fleet  # the file readers only where a file is read (see COMMANDS)
    from lorafaas.cli.function_file import is_fleet, read_function_file

    flags = {"name": name, "backbone": backbone, "slo_ttft_ms": slo_ttft_ms, "keep_alive_s": keep_alive_s,
             "min_instances": min_instances, "max_instances": max_instances, "max_tokens_limit": max_tokens_limit,
             "max_request_s": max_request_s, "lora_mode": lora_mode, "shared_base": shared_base, "tenant": tenant}
    if file is not None and is_fleet(file):
        if replace or adapter is not None:
            raise InvalidInput(f"{file} deploys many functions: --replace and --adapter take one function")
        specs = read_fleet(file, flags)
        with client_for(ctx, url) as client:
            if not deploy_fleet(client, specs, batch_size, as_json):
                raise typer.Exit(2)
        return
    spec = read_function_file(file) if file else {}
    spec |= {k: v for k, v in flags.items() if v is not None}
    adapter_dir = adapter or (Path(spec["adapter"]) if spec.get("adapter") is not None else None)
    spec.pop("adapter", None)
    if not spec.get("name"):
        raise InvalidInput("give the function's name (NAME or `name:` in -f)")
    with client_for(ctx, url) as client:
        if replace:
            fn = spec.pop("name")
            _drop_unchanged_identity(spec, client.describe(fn)["function"], f"-f {file}" if file else "the flags")
            result = client.update(fn, spec, adapter_dir)
        else:
            if adapter_dir is None or not spec.get("backbone"):
                raise InvalidInput("deploy needs --adapter PATH and --backbone NAME (or `adapter:` and `backbone:`)")
            result = client.deploy(spec, adapter_dir)
    if as_json:
        print_json(result)
    else:
        call = hint(ctx, url, f'invoke {result["name"]} "..."')
        err_console.print(f"deployed [bold]{result['name']}[/] version {result['version']} on {result['backbone']} "
                          f"(adapter {result['adapter_digest'][:12]}); call it with `{escape(call)}`", highlight=False)


def _drop_unchanged_identity(spec: dict, current: dict, source: str) -> None:
    """`--replace` changes settings and the adapter, never what a function is: a backbone or tenant that differs
    from the stored one is refused before anything is sent; an unchanged one is dropped from the update."""
    for field in ("backbone", "tenant"):
        wanted = spec.pop(field, None)
        if wanted is not None and wanted != current[field]:
            raise InvalidInput(
                f"function {current['name']!r} has {field} {current[field]!r}, and {source} names {wanted!r}: "
                f"--replace cannot change a function's {field}; deploy it under a new name, or delete "
                f"{current['name']!r} first"
            )


def list_functions(ctx: typer.Context, url: str | None = URL, as_json: bool = JSON) -> None:
    """List functions."""
    with client_for(ctx, url) as client:
        functions = client.list()
    if as_json:
        print_json(msgspec.to_builtins(functions))
        return
    # Plain columns, not a rich table: a fleet of a thousand functions lists in milliseconds, not seconds.
    print_columns(("NAME", "TENANT", "BACKBONE", "ADAPTER", "VERSION", "SLO TTFT", "KEEP-ALIVE", "MIN/MAX"),
                  [(f.name, f.tenant, f.backbone, f.adapter_digest[:12], str(f.version), f"{f.slo_ttft_ms} ms",
                    f"{f.keep_alive_s:g} s", f"{f.min_instances}/{f.max_instances}") for f in functions])


def describe(ctx: typer.Context, name: str, url: str | None = URL, as_json: bool = JSON) -> None:
    """Show a function's spec, its instances (pid, device, state) and its last cold start."""
    with client_for(ctx, url) as client:
        info = client.describe(name)
    if as_json:
        print_json(info)
        return
    spec = info["function"]
    console.print(f"[bold]{spec['name']}[/] (tenant {spec['tenant']}) version {spec['version']}: backbone "
                  f"{spec['backbone']}, adapter {spec['adapter_digest'][:12]}, SLO {spec['slo_ttft_ms']} ms, "
                  f"keep-alive {spec['keep_alive_s']:g} s, instances {spec['min_instances']}..{spec['max_instances']}"
                  + (f", LoRA mode {spec['lora_mode']}" if spec.get("lora_mode") else "")
                  + ("" if spec.get("shared_base", True) else ", never in a shared base pass"))
    table = Table("instance", "pid", "device", "state", "in flight", "adapter", "cold start")
    for i in info["instances"]:
        table.add_row(i["instance_id"], str(i["pid"]), i["device"], i["state"], str(i["in_flight"]),
                      _adapter(i.get("adapter")) + (" (shared base pass)" if i.get("shared_base") else ""),
                      _breakdown(i["cold_start"]))
    print_table(table)
    if info.get("registration"):
        console.print(f"registration: {_breakdown(info['registration'])}")
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
    prompt: str | None = typer.Argument(None, help="The prompt; omitted or -, it is read from stdin.",
                                        show_default=False),
    stream: bool = typer.Option(False, "--stream", help="Print tokens as they arrive (with --json: one JSON "
                                                         "event per line)."),
    max_tokens: int | None = typer.Option(None, "--max-tokens", help="Upper bound on generated tokens "
                                                                      "(default: the platform's).", show_default=False),
    temperature: float | None = typer.Option(None, "--temperature", help="0 is greedy (the default).",
                                             show_default=False),
    top_p: float | None = typer.Option(None, "--top-p", help="Nucleus sampling: keep the most likely tokens "
                                                              "up to this probability mass.", show_default=False),
    seed: int | None = typer.Option(None, "--seed", help="The same seed gives the same sample.", show_default=False),
    stop: list[str] | None = typer.Option(None, "--stop", help="Stop at this text (repeat for several).",
                                          show_default=False),
    system: str | None = typer.Option(None, "--system", help="A system message before the prompt.",
                                      show_default=False),
    raw: bool = typer.Option(False, "--raw", help="Send PROMPT as plain text, without the chat template."),
    run_async: bool = typer.Option(False, "--async", help="Print the invocation id at once and return; see "
                                                          "`lorafaas invocations get|wait ID`."),
    url: str | None = URL,
    as_json: bool = JSON,
) -> None:
    """Call a function."""
    if prompt is None or prompt == "-":
        if prompt is None and sys.stdin.isatty():
            raise InvalidInput("give PROMPT, or pipe it on stdin")
        prompt = sys.stdin.read()
    if not prompt:
        raise InvalidInput("the prompt is empty")
    if raw and system is not None:
        raise InvalidInput("--system needs the chat template; it cannot go with --raw")
    given = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "seed": seed, "stop": stop or None}
    body: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    if raw:
        body["prompt"] = prompt
    else:
        system_turn = [{"role": "system", "content": system}] if system is not None else []
        body["messages"] = [*system_turn, {"role": "user", "content": prompt}]
    with client_for(ctx, url) as client:
        if run_async:
            accepted = client.invoke_async(name, body)
            if as_json:
                print_json(accepted)
            else:
                print_text(accepted["invocation_id"])
                wait = hint(ctx, url, f"invocations wait {accepted['invocation_id']}")
                err_console.print(f"accepted; `{wait}` prints the result", markup=False)
            return
        if stream:
            for event in client.invoke_stream(name, body):
                if as_json:
                    print_json_line(event)
                elif event["type"] == "token":
                    print_text(event["text"], end="", flush=True)
            if not as_json:
                print_text("")
            return
        result = client.invoke(name, body)
    if as_json:
        print_json(result)
    else:
        print_text(result["text"])


def logs(
    ctx: typer.Context,
    name: str,
    tail: int | None = typer.Option(None, "--tail", min=0, help="Only the last N lines of each instance.",
                                    show_default=False),
    since: str | None = typer.Option(None, "--since", show_default=False,
                                     help="Only lines logged since then: a duration back from now (30s, 5m, 2h, "
                                          "1d) or a local time (2026-11-24T06:52:47)."),
    follow: bool = typer.Option(False, "--follow", help="Keep printing lines as they are logged, until "
                                                         "interrupted or the function is deleted."),
    url: str | None = URL,
    as_json: bool = typer.Option(False, "--json", help='Print {"function", "text"}; with --follow, one '
                                                       '{"instance", "text", "logged_at"} per line.'),
) -> None:
    """Print the logs of a function's instances (each under a `==> instance <==` header), verbatim."""
    since_ts = parse_since(since) if since is not None else None
    with client_for(ctx, url) as client:
        text = client.logs(name, tail, since_ts)
        if not follow:
            if as_json:
                print_json({"function": name, "text": text})
            else:
                print_text(text, end="" if text.endswith("\n") or not text else "\n")
            return
        try:
            follow_logs(client, name, log_lines.parse(text), as_json)
        except KeyboardInterrupt:
            raise typer.Exit(130) from None


def follow_logs(client: ApiClient, name: str, lines: list[log_lines.LogLine], as_json: bool) -> None:
    """Print `lines`, then every line logged after them, polling the gateway by time stamp: each poll asks for the
    lines logged at the newest stamp printed or later, and skips those of that stamp it printed already."""
    instance: str | None = None
    cursor: float | None = None  # the newest stamp printed
    printed: Counter = Counter()  # (instance, text) of the lines printed at `cursor` (all of them while it is None)
    while True:
        for line in lines:
            if as_json:
                print_json_line({"instance": line.instance, "text": line.text, "logged_at": line.logged_at})
            else:
                if line.instance != instance:
                    print_text(f"==> {line.instance} <==")
                    instance = line.instance
                print_text(line.text, flush=True)
            if line.logged_at is not None and (cursor is None or line.logged_at > cursor):
                cursor, printed = line.logged_at, Counter()
            if line.logged_at == cursor:
                printed[(line.instance, line.text)] += 1
        time.sleep(FOLLOW_POLL_S)
        try:
            polled = log_lines.parse(client.logs(name, since=cursor))
        except FunctionNotFound:
            err_console.print(f"function {name} was deleted; stopped following its logs")
            return
        already = printed.copy()  # every poll returns the lines of stamp `cursor` again
        lines = []
        for line in polled:
            key = (line.instance, line.text)
            if line.logged_at == cursor and already[key] > 0:
                already[key] -= 1
                continue
            lines.append(line)


def parse_since(value: str) -> float:
    """`--since`: a duration back from now (30s, 5m, 2h, 1d) or a local ISO time, as unix time."""
    duration = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", value.strip())
    if duration:
        return time.time() - float(duration.group(1)) * SECONDS_PER[duration.group(2)]
    try:
        return datetime.fromisoformat(value.strip()).timestamp()
    except ValueError:
        raise InvalidInput(f"--since {value!r} is neither a duration (30s, 5m, 2h, 1d) nor a time like "
                           "2026-11-24T06:52:47") from None


def scale(
    ctx: typer.Context,
    name: str,
    min_instances: int | None = typer.Option(None, "--min", help="Instances kept ready at all times."),
    max_instances: int | None = typer.Option(None, "--max", help="Upper bound on instances."),
    url: str | None = URL,
    as_json: bool = typer.Option(False, "--json", help="Print the updated function."),
) -> None:
    """Set a function's minimum and maximum number of instances."""
    changes = {k: v for k, v in {"min_instances": min_instances, "max_instances": max_instances}.items()
               if v is not None}
    if not changes:
        raise InvalidInput("give --min and/or --max")
    with client_for(ctx, url) as client:
        spec = client.update(name, changes)
    if as_json:
        print_json(spec)
    else:
        err_console.print(f"{name}: instances {spec['min_instances']}..{spec['max_instances']}")


def delete(ctx: typer.Context, name: str, url: str | None = URL,
           as_json: bool = typer.Option(False, "--json", help='Print {"deleted": NAME}.')) -> None:
    """Delete a function and stop its instances."""
    with client_for(ctx, url) as client:
        deleted = client.delete(name)
    if as_json:
        print_json(deleted)
    else:
        err_console.print(f"deleted {name}")


keys_app = typer.Typer(help="API keys (admin key only).", no_args_is_help=True)


@keys_app.command("create")
def create_key(ctx: typer.Context, tenant: str, url: str | None = URL, as_json: bool = JSON) -> None:
    """Make an API key for TENANT; it is printed once and stored only hashed."""
    with client_for(ctx, url) as client:
        created = client.create_key(tenant)
    if as_json:
        print_json(created)
    else:
        err_console.print(f"key {created['key_id']} for tenant {tenant} (shown once, keep it safe):")
        console.print(created["key"], markup=False)


@keys_app.command("list")
def list_keys(ctx: typer.Context, url: str | None = URL, as_json: bool = JSON) -> None:
    """List API keys (ids and tenants; never the keys)."""
    with client_for(ctx, url) as client:
        keys = client.list_keys()
    if as_json:
        print_json(msgspec.to_builtins(keys))
        return
    table = Table("key id", "tenant", "admin", "created", "last used")
    for k in keys:
        table.add_row(k.key_id, k.tenant, "yes" if k.is_admin else "", _when(k.created_at),
                      _when(k.last_used_at) or "never")
    print_table(table)


@keys_app.command("revoke")
def revoke_key(ctx: typer.Context, key_id: str, url: str | None = URL,
               as_json: bool = typer.Option(False, "--json", help='Print {"revoked", "tenant"}.')) -> None:
    """Revoke the key KEY_ID (see `keys list`): requests with it get 401 from now on."""
    with client_for(ctx, url) as client:
        revoked = client.revoke_key(key_id)
    if as_json:
        print_json(revoked)
        return
    err_console.print(f"revoked key {revoked['revoked']} of tenant {revoked['tenant']}")


def _when(timestamp: float | None) -> str:
    if timestamp is None:
        return ""
    return datetime.fromtimestamp(timestamp, tz=UTC).strftime("%Y-%m-%d %H:%M UTC")
