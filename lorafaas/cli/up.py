"""`lorafaas up`: the whole local platform in the foreground."""

from __future__ import annotations

import logging
import os
import shlex
import signal
from pathlib import Path

import typer

from lorafaas.cli.output import RichProgress, err_console
from lorafaas.config import LorafaasConfig
from lorafaas.errors import InvalidInput
from lorafaas.platform.api_client import forget_url, record_url


def up(
    ctx: typer.Context,
    port: int = typer.Option(8080, "--port", min=1, max=65535),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    devices: str = typer.Option("cpu", "--devices",
                                help="cpu, cpu=8G (memory budget), or GPUs: cuda:0=20G,cuda:1=20G (a backbone daemon "
                                     "per GPU and backbone; no budget: 80% of the GPU's free memory)."),
    state_url: str | None = typer.Option(None, "--state", envvar="LORAFAAS_STATE_URL",
                                         help="redis://host:port/db for a shared store (default: SQLite in home)."),
    demo: bool = typer.Option(False, "--demo", help="Import smollm2-135m and deploy the demo functions if absent."),
    policy: str = typer.Option("lorafaas", "--policy",
                               help="Scheduler mechanisms: lorafaas (all), or an ablation: no-preload, no-offload, "
                                    "fixed-batch (batch size 1), fixed-keep-alive (no idle-time histogram)."),
    backend: str = typer.Option("local", "--backend",
                                help="local (processes here) or kubernetes (pods; the Helm chart's controller)."),
    compute_slots: int | None = typer.Option(None, "--compute-slots", min=1,
                                             help="Instances the device runs at full speed at once; a function "
                                                  "scales out only while fewer are busy (default: cores on a CPU, "
                                                  "1 on a GPU)."),
    threads_per_instance: int = typer.Option(1, "--threads-per-instance", min=1, max=256,
                                             help="Torch threads of each function instance; on a CPU the compute "
                                                  "slots default to cores / this (docs/performance.md measures 1 "
                                                  "and 2 here)."),
    strict_compute: bool = typer.Option(False, "--strict-compute/--no-strict-compute",
                                        help="Never more busy instances than compute slots, functions taking turns "
                                             "by batches. Off (default): every function may run one instance on a "
                                             "full device, time-sliced by the OS; measured faster here on tokens/s "
                                             "and first-token latency (docs/performance.md)."),
    step_gate: bool = typer.Option(True, "--step-gate/--no-step-gate",
                                   help="Local CPU workers ask the device's step gate before each engine step: "
                                        "never more compute at once than there are compute slots, counted across "
                                        "functions, and one instance computing alone gets every core."),
    lone_threads: int | None = typer.Option(None, "--lone-threads", min=1, max=256,
                                            help="Torch threads of an instance computing alone under the step "
                                                 "gate (default: every core)."),
    shared_base: bool | None = typer.Option(None, "--shared-base/--no-shared-base",
                                            help="Local CPU workers may send the backbone's linear layers to the "
                                                 "backbone daemon's shared base pass, batched with other functions' "
                                                 "rows (attention, KV cache, adapter and sampling stay in each "
                                                 "function's process). Default: on with the step gate (local "
                                                 "workers), which sends the functions stepping at once to the pass "
                                                 "while it measures faster than their own steps (docs/performance."
                                                 "md, \"The shared base pass\"); with --no-step-gate, --shared-base "
                                                 "sends every step."),
    standby_workers: int | None = typer.Option(None, "--standby-workers", min=0, max=64,
                                               help="Pre-forked worker processes kept per backbone, backbone "
                                                    "attached and warmed up, each given to one new function's first "
                                                    "instance for its whole life (default 1; 0: none)."),
    shared_base_from: int | None = typer.Option(None, "--shared-base-from", min=2, max=255,
                                                help="A fixed override of the measured choice: members' steps go to "
                                                     "the shared base pass while at least this many step at once; "
                                                     "below, each computes its own."),
    max_batch: int = typer.Option(32, "--max-batch", min=1, max=256,
                                  help="Requests one function instance batches at most (its worker's capacity); "
                                       "requests beyond every instance's capacity wait for a place."),
    hang_timeout: float = typer.Option(10.0, "--hang-timeout", min=0.1,
                                       help="Seconds an instance holding requests may leave a heartbeat unanswered "
                                            "before it is declared hung: its requests are retried or failed, and "
                                            "it is killed and replaced."),
    start_timeout: float = typer.Option(120.0, "--start-timeout", min=1.0, max=3600,
                                        help="Seconds a function instance's start (spawn, libraries, backbone, "
                                             "adapter, warm-up) may take before it is killed and counted a failed "
                                             "start."),
    host_tier: str = typer.Option(None, "--host-tier",
                                  help="Memory that keeps the backbones of stopped CPU daemons for their next start "
                                       "(e.g. 8G; 0 off; default: a quarter of the machine's memory, at most 8G)."),
    idle_budget: str = typer.Option(None, "--idle-budget",
                                    help="Memory the node's idle instances may hold (e.g. 4G); beyond it the lowest "
                                         "expected saving per byte retire (default: half the machine's memory)."),
    rank_blind: bool = typer.Option(False, "--rank-blind", hidden=True,
                                    help="Benchmark switch: the scheduler prices every adapter alike, whatever its "
                                         "rank and target modules (docs/scheduler.md, \"Rank-aware costs\")."),
    tenant_adapter_quota: str = typer.Option("10G", "--tenant-adapter-quota",
                                             help="Adapter storage each tenant's functions may take (e.g. 10G)."),
    upload_timeout: float = typer.Option(20.0, "--upload-timeout", min=0.1, max=3600,
                                         help="Seconds an adapter upload may send nothing before it is cut (408), "
                                              "and its grace before --upload-min-rate counts."),
    upload_min_rate: str = typer.Option("32K", "--upload-min-rate",
                                         help="Bytes per second an adapter upload must average after its first "
                                              "--upload-timeout seconds (e.g. 32K); slower ones are cut (408)."),
) -> None:
    """Run the local platform (gateway, node agent, stores) until interrupted."""
    from lorafaas.platform.server import ServerConfig, parse_devices, parse_size, run_server

    config: LorafaasConfig = ctx.obj
    if shared_base_from is not None and (shared_base is False or not step_gate):
        raise typer.BadParameter("needs the shared base pass and the step gate (without the gate every member's step "
                                 "goes to the shared base pass)", param_hint="--shared-base-from")
    if shared_base is None:  # the measured choice needs the gate's step times: local workers (pods run ungated)
        shared_base = step_gate and backend == "local"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server_config = ServerConfig(
        home=config.home, host=host, port=port, devices=parse_devices(devices), state_url=state_url,
        admin_key=_admin_key_from_env(), demo=demo, policy=policy, backend=backend,
        compute_slots=compute_slots, threads_per_instance=threads_per_instance, strict_compute=strict_compute,
        step_gate=step_gate, lone_threads=lone_threads, shared_base=shared_base, shared_base_from=shared_base_from,
        hang_timeout_s=hang_timeout, start_timeout_s=start_timeout,
        max_batch_size=max_batch,
        tenant_adapter_bytes=parse_size(tenant_adapter_quota, "--tenant-adapter-quota"),
        host_tier_bytes=None if host_tier is None else 0 if host_tier.strip() == "0" else parse_size(host_tier,
                                                                                                   "--host-tier"),
        upload_timeout_s=upload_timeout, upload_min_rate_bytes_s=parse_size(upload_min_rate, "--upload-min-rate"),
        idle_budget_bytes=None if idle_budget is None else 0 if idle_budget.strip() == "0" else parse_size(
            idle_budget, "--idle-budget"),
        rank_aware=not rank_blind,
        standby_workers=standby_workers,
    )
    url = f"http://{_local_address(host)}:{port}"
    # The hints name the home only when it differs from the one a plain `lorafaas` in this shell uses; the URL needs
    # no flag: the CLI finds it in the home (recorded below once the platform serves).
    home_flag = f" --home {shlex.quote(str(config.home))}" if config.home != LorafaasConfig.from_env().home else ""
    if demo:  # the one long step of a first start, with its progress bar, before the server starts
        from lorafaas.formats.model_store import ModelStore
        from lorafaas.platform.builtin_backbones import DEFAULT_BACKBONE, import_builtin

        with RichProgress() as progress:
            import_builtin(ModelStore(config.models_dir), DEFAULT_BACKBONE, progress)

    def announce(platform, demo_names: list[str]) -> None:
        if platform.new_admin_key:
            err_console.print(f"[bold]admin key[/] (shown once; also kept in {config.home / 'admin.key'}, mode 0600):")
            err_console.print(platform.new_admin_key, markup=False)
        record_url(config.home, url)
        err_console.print(f"[green]lorafaas is up[/] at {url} (home {config.home}); Ctrl-C stops it")
        for name in demo_names[:1]:
            key = f"$(cat {config.home}/admin.key)"
            body = '{"messages": [{"role": "user", "content": "Tell me about the ocean."}], "stream": true}'
            err_console.print(
                f"try:\n  lorafaas{home_flag} invoke {name} \"Tell me about the ocean.\"\n"
                f"  curl -N {url}/v1/functions/{name}/invoke -H \"Authorization: Bearer {key}\" "
                f"-H 'Content-Type: application/json' -d '{body}'\n"
                f"  OpenAI client: base_url='{url}/v1', api_key=<the admin key>, model='{name}'",
                markup=False,
            )
        if demo_names:
            err_console.print(f"demo functions: {', '.join(demo_names)}")

    def forget_then_terminate(sig: int, _frame) -> None:
        # uvicorn stops on SIGTERM, restores the handler it found (this one) and raises the signal again: the URL is
        # forgotten here, then the process ends by the signal as before (exit status -15 to its parent).
        forget_url(config.home, url)
        signal.signal(sig, signal.SIG_DFL)
        signal.raise_signal(sig)

    previous = signal.signal(signal.SIGTERM, forget_then_terminate)
    try:
        run_server(server_config, on_ready=announce)
    finally:  # a normal return, Ctrl-C or a failure to start
        signal.signal(signal.SIGTERM, previous)
        forget_url(config.home, url)


def _local_address(host: str) -> str:
    """The address a client on this machine reaches a server listening on `host` at (any-address -> loopback)."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _admin_key_from_env() -> str | None:
    """LORAFAAS_ADMIN_KEY, or the contents of the file LORAFAAS_ADMIN_KEY_FILE names (a mounted Secret)."""
    if os.environ.get("LORAFAAS_ADMIN_KEY"):
        return os.environ["LORAFAAS_ADMIN_KEY"]
    key_file = os.environ.get("LORAFAAS_ADMIN_KEY_FILE")
    if not key_file:
        return None
    try:
        return Path(key_file).read_text().strip()
    except OSError as exc:
        raise InvalidInput(f"LORAFAAS_ADMIN_KEY_FILE {key_file!r} cannot be read: {exc.strerror}") from exc
