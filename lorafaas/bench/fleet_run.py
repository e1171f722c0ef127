"""One `lorafaas bench fleet` run: write the fleet, then each server in turn (lorafaas, then vLLM), see fleet.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import msgspec

from lorafaas.bench.control_plane import median_s
from lorafaas.bench.fleet import (
    FleetConfig,
    FleetResult,
    HealthzPoller,
    LorafaasFigures,
    ServerFigures,
    cold_starts_by_kind,
    delete_lorafaas,
    deploy_lorafaas,
    drive,
    list_cli_s,
    listening_pid,
    names_of,
    shown_config,
    summarize_server,
)
from lorafaas.bench.serve import Target, make_prompts
from lorafaas.bench.serve_stats import LoadProbe
from lorafaas.formats.model_store import ModelStore
from lorafaas.platform.api_client import ApiClient
from lorafaas.progress import ProgressSink, SilentProgress
from lorafaas.testing.fleet_workload import arrivals, fleet_plan
from lorafaas.testing.synthetic_adapters import write_fleet


class ServerSpec(msgspec.Struct, frozen=True, kw_only=True):
    url: str  # base URL, without /v1
    pid: int | None = None  # the server's root process (its tree's PSS is sampled); found by port when None


def run_fleet_bench(config: FleetConfig, home: Path, prefix: str, lorafaas: ServerSpec | None,
                    vllm: ServerSpec | None, progress: ProgressSink | None = None,
                    rank_blind: ServerSpec | None = None) -> FleetResult:
    """`rank_blind`: a second platform (`lorafaas up --rank-blind`, the same admin key) run as `lorafaas` is, after
    it, as the server "lorafaas-rank-blind"."""
    progress = progress or SilentProgress()
    spec = config.workload
    adapters = write_fleet(Path(config.adapters_dir), ModelStore(home / "models"), config.backbone,
                           fleet_plan(spec.functions, spec.seed, prefix), progress)
    schedule = arrivals(spec)
    prompts = make_prompts(spec.prompts, config.prompt_len, spec.seed)
    servers = []
    if lorafaas is not None:
        servers.append(_run_lorafaas(lorafaas, adapters, schedule, prompts, config, home, progress))
    if rank_blind is not None:
        servers.append(_run_lorafaas(rank_blind, adapters, schedule, prompts, config, home, progress,
                                     label="lorafaas-rank-blind"))
    if vllm is not None:
        servers.append(_run_vllm(vllm, adapters, schedule, prompts, config, progress))
    return FleetResult(config=shown_config(config), arrivals=len(schedule),
                       functions_called=len({a.function for a in schedule}), servers=tuple(servers))


def _client_limits(config: FleetConfig) -> httpx.Limits:
    # open loop: as many connections as requests can be in flight (rate x (duration + drain)), bounded
    in_flight = int(config.workload.rate_per_s * (config.workload.duration_s + config.drain_s)) + 8
    return httpx.Limits(max_connections=min(in_flight, 2048), max_keepalive_connections=64)


async def _drive_measured(server: ServerSpec, label: str, models: list[str], schedule, prompts, config: FleetConfig,
                          progress: ProgressSink, healthz: bool):
    pid = server.pid or listening_pid(server.url)
    probe = LoadProbe(pid)
    poller = HealthzPoller(server.url, config.healthz_interval_s) if healthz else None
    timeout = httpx.Timeout(config.drain_s + config.workload.duration_s, connect=60.0)
    async with httpx.AsyncClient(timeout=timeout, limits=_client_limits(config)) as http:
        probe.start()
        if poller is not None:
            await poller.start()
        try:
            outcomes, wall_s, lag_s = await drive(http, Target(label=label, url=server.url, server_pid=pid),
                                                  models, schedule, prompts, config, progress)
        finally:
            if poller is not None:
                await poller.stop()
            load = probe.stop()
    return outcomes, wall_s, lag_s, load, poller


def _run_lorafaas(server: ServerSpec, adapters: list[Path], schedule, prompts, config: FleetConfig, home: Path,
                  progress: ProgressSink, label: str = "lorafaas") -> ServerFigures:
    from lorafaas.stats import percentile

    key = config.api_key or ""
    names = names_of(adapters)
    with ApiClient(server.url, key) as client:
        deploy = deploy_lorafaas(client, adapters, config, progress)
        try:
            outcomes, wall_s, lag_s, load, poller = asyncio.run(_drive_measured(
                server, label, names, schedule, prompts, config, progress, healthz=True))
            progress.stage(f"{label}: timing `lorafaas list` and /metrics")
            with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as http:
                text = http.get("/metrics").raise_for_status().text
                scrape_s = median_s(lambda: http.get("/metrics").raise_for_status())
            list_s = list_cli_s(server.url, key, home)
        finally:
            delete_lorafaas(client, adapters, progress)
    assert poller is not None
    healthz_ms = [s * 1e3 for s in poller.latencies_s]
    figures = LorafaasFigures(
        list_cli_s=list_s, metrics_bytes=len(text.encode()), scrape_ms=scrape_s * 1e3,
        healthz_p99_ms=percentile(healthz_ms, 99, 0.0), healthz_max_ms=max(healthz_ms, default=0.0),
        healthz_polls=len(healthz_ms), healthz_failed=poller.failed, healthz_interval_s=config.healthz_interval_s,
        cold_starts=cold_starts_by_kind(text, set(names)))
    return summarize_server(label, server.url, len(adapters), deploy, outcomes, wall_s, lag_s, load, config,
                            figures)


def _run_vllm(server: ServerSpec, adapters: list[Path], schedule, prompts, config: FleetConfig,
              progress: ProgressSink) -> ServerFigures:
    names = names_of(adapters)
    with httpx.Client(base_url=server.url, timeout=600) as http:
        deploy = _register_vllm(http, adapters, progress)
        try:
            outcomes, wall_s, lag_s, load, _ = asyncio.run(_drive_measured(
                server, "vllm", names, schedule, prompts, config, progress, healthz=False))
        finally:
            progress.stage(f"vllm: unloading the {len(adapters)} adapters", total=len(adapters))
            for name in names:
                http.post("/v1/unload_lora_adapter", json={"lora_name": name})
                progress.advance()
    return summarize_server("vllm", server.url, len(adapters), deploy, outcomes, wall_s, lag_s, load, config)


def _register_vllm(http: httpx.Client, adapters: list[Path], progress: ProgressSink) -> tuple[list[str], float]:
    """(why each refused adapter was, seconds) of registering each adapter by path (`/v1/load_lora_adapter`); one
    vLLM holds already (a run that did not finish) counts as registered."""
    import time

    progress.stage(f"vllm: registering {len(adapters)} adapters", total=len(adapters))
    refused: list[str] = []
    started = time.perf_counter()
    for adapter in adapters:
        reply = http.post("/v1/load_lora_adapter", json={"lora_name": adapter.name,
                                                          "lora_path": str(adapter.resolve())})
        if reply.status_code != 200 and "already been loaded" not in reply.text:
            refused.append(f"{adapter.name}: HTTP {reply.status_code} {reply.text[:200]}")
        progress.advance()
    return refused, time.perf_counter() - started
