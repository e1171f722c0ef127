"""`lorafaas bench fleet`: N functions on one machine under an open-loop Zipf workload, against vLLM holding the same N.

1. N adapters of the backbone (ranks 4-64, attention-only, q/v-only or all-linear: synthetic_adapters.fleet_plan)
   are written from seeds into `adapters_dir` (kept between runs: a second run over the same fleet writes nothing).
2. lorafaas: the N are deployed as N functions by `POST /v1/functions:batch` (`deploy_s`); vLLM: the N are
   registered by `POST /v1/load_lora_adapter` (its `deploy_s`), vLLM's run-time loading (its LRU of
   `--max-cpu-loras` adapters in host memory, `--max-loras` active in a step, the rest read from disk on demand).
3. The same seeded arrival sequence (fleet_workload) runs against each server in turn, never both at once: Poisson
   at the total rate, Zipf function choice, a fixed prompt set, fixed output length with `ignore_eos`, streaming
   `/v1/completions` (bench serve's client). Arrivals never wait for completions; requests still running at the
   end are awaited up to `drain_s` and then counted failed ("still running after the drain").
4. Per server: TTFT p50/p99/p99.9, share under the TTFT SLO (over every request sent: a failure misses it),
   end-to-end, output tokens/s (over the run and its drain), failures by reason, peak PSS of the server's process
   tree, and the machine's load (bench serve's LoadProbe). For lorafaas also: `lorafaas list` latency (the CLI as a
   process), /metrics size and scrape time, gateway /healthz p99 polled every `healthz_interval_s` during the run,
   cold starts by kind (the `lorafaas_cold_starts` series of the fleet's functions). Its N functions are deleted
   at the end, and vLLM's N adapters unloaded.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import httpx
import msgspec

from lorafaas.bench.control_plane import deploy_batches, median_s
from lorafaas.bench.serve import ServeBenchConfig, Target, one_request, shown_key
from lorafaas.bench.serve_stats import MachineLoad, RequestOutcome
from lorafaas.platform.api_client import ApiClient
from lorafaas.progress import ProgressSink, SilentProgress
from lorafaas.stats import percentile
from lorafaas.testing.fleet_workload import Arrival, WorkloadSpec


class FleetConfig(msgspec.Struct, frozen=True, kw_only=True):
    workload: WorkloadSpec
    backbone: str
    adapters_dir: str
    output_len: int = 32
    prompt_len: int = 32
    slo_ttft_s: float = 1.0
    batch_size: int = 100
    drain_s: float = 120.0  # how long requests still running at the end are awaited
    healthz_interval_s: float = 0.2
    api_key: str | None = None


class LorafaasFigures(msgspec.Struct, frozen=True, kw_only=True):
    list_cli_s: float  # `lorafaas list` as a process with the N functions deployed (median of 3)
    metrics_bytes: int
    scrape_ms: float  # GET /metrics (median of 3), after the run
    healthz_p99_ms: float
    healthz_max_ms: float
    healthz_polls: int
    healthz_failed: int
    healthz_interval_s: float
    cold_starts: dict[str, int]  # kind -> count over the fleet's functions


class ServerFigures(msgspec.Struct, frozen=True, kw_only=True):
    server: str  # "lorafaas" or "vllm"
    url: str
    functions: int
    deploy_s: float  # lorafaas: the batch deploy of N functions; vLLM: registering N adapters
    deploy_refused: int
    deploy_refusals: list[str]  # the first few reasons
    requests: int
    completed: int
    failed: int
    failures: dict[str, int]  # reason -> count
    short_replies: int  # completed before output_len tokens: the server did not honour ignore_eos
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_p999_ms: float
    slo_attainment: float  # share of all requests sent whose first token came under the SLO
    e2e_p50_ms: float
    e2e_p99_ms: float
    output_tokens: int
    output_tokens_per_s: float
    wall_s: float  # from the first arrival's slot to the last completion
    max_send_lag_ms: float  # how late the client sent its most late request (a busy client skews open loop)
    peak_pss_mb: float | None
    load: MachineLoad
    lorafaas: LorafaasFigures | None = None


class FleetResult(msgspec.Struct, frozen=True, kw_only=True):
    config: FleetConfig
    arrivals: int
    functions_called: int  # distinct functions the arrivals name
    servers: tuple[ServerFigures, ...]


async def drive(http: httpx.AsyncClient, target: Target, models: Sequence[str], schedule: Sequence[Arrival],
                prompts: Sequence[str], config: FleetConfig, progress: ProgressSink
                ) -> tuple[list[RequestOutcome], float, float]:
    """Send each arrival at its offset without waiting for earlier ones; (outcomes, wall_s, max send lag in s)."""
    request_config = ServeBenchConfig(models=tuple(models[:1]), concurrencies=(1,), requests=1,
                                      output_len=config.output_len, ignore_eos=True, api_key=config.api_key)
    progress.stage(f"{target.label}: {len(schedule)} requests over {config.workload.duration_s:.0f} s",
                   total=len(schedule))

    async def send(arrival: Arrival) -> RequestOutcome:
        outcome = await one_request(http, target, models[arrival.function], prompts[arrival.prompt],
                                    request_config)
        progress.advance()
        return outcome

    start = time.perf_counter()
    tasks = []
    lag = 0.0
    for arrival in schedule:
        delay = start + arrival.at_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        lag = max(lag, -delay)
        tasks.append(asyncio.create_task(send(arrival)))
    if tasks:
        await asyncio.wait(tasks, timeout=max(0.0, start + config.workload.duration_s - time.perf_counter())
                           + config.drain_s)
    outcomes = []
    for task, arrival in zip(tasks, schedule, strict=True):
        if task.done():
            outcomes.append(task.result())
        else:
            task.cancel()
            outcomes.append(RequestOutcome(model=models[arrival.function], ok=False,
                                           error=f"still running {config.drain_s:.0f} s after the end"))
    return outcomes, time.perf_counter() - start, lag


class HealthzPoller:
    """GET /healthz every `interval_s` while the run goes, from a process of its own (healthz_probe.py);
    latencies in seconds."""

    def __init__(self, url: str, interval_s: float) -> None:
        self.url, self.interval_s = url, interval_s
        self.latencies_s: list[float] = []
        self.failed = 0
        self._process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self._process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "lorafaas.bench.healthz_probe", self.url, str(self.interval_s),
            stdout=asyncio.subprocess.PIPE)

    async def stop(self) -> None:
        if self._process is None:
            return
        self._process.terminate()
        out, _ = await self._process.communicate()
        try:
            polled = msgspec.json.decode(out)
        except msgspec.DecodeError:  # the probe died: every poll it would have made is unknown
            self.failed += 1
            return
        self.latencies_s, self.failed = polled["latencies_s"], polled["failed"]


def summarize_server(server: str, url: str, functions: int, deploy: tuple[list[str], float],
                     outcomes: list[RequestOutcome],
                     wall_s: float, lag_s: float, load: MachineLoad, config: FleetConfig,
                     lorafaas: LorafaasFigures | None = None) -> ServerFigures:
    done = [o for o in outcomes if o.ok]
    ttft_ms = [o.ttft_s * 1e3 for o in done]
    e2e_ms = [o.latency_s * 1e3 for o in done]
    tokens = sum(o.output_tokens for o in done)
    under = sum(1 for o in done if o.ttft_s <= config.slo_ttft_s)
    return ServerFigures(
        server=server, url=url, functions=functions, deploy_refused=len(deploy[0]),
        deploy_refusals=list(dict.fromkeys(deploy[0]))[:5], deploy_s=deploy[1],
        requests=len(outcomes), completed=len(done), failed=len(outcomes) - len(done),
        failures=dict(Counter(o.error[:160] for o in outcomes if not o.ok).most_common(10)),
        short_replies=sum(1 for o in done if o.output_tokens < config.output_len),
        ttft_p50_ms=percentile(ttft_ms, 50, 0.0), ttft_p99_ms=percentile(ttft_ms, 99, 0.0),
        ttft_p999_ms=percentile(ttft_ms, 99.9, 0.0), slo_attainment=under / len(outcomes) if outcomes else 0.0,
        e2e_p50_ms=percentile(e2e_ms, 50, 0.0), e2e_p99_ms=percentile(e2e_ms, 99, 0.0), output_tokens=tokens,
        output_tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0, wall_s=wall_s, max_send_lag_ms=lag_s * 1e3,
        peak_pss_mb=load.server_pss_peak_mb, load=load, lorafaas=lorafaas)


def cold_starts_by_kind(metrics_text: str, functions: set[str]) -> dict[str, int]:
    """Sum of `lorafaas_cold_starts{function, kind}` over `functions`, by kind."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "lorafaas_cold_starts":
            continue
        for sample in family.samples:
            if sample.labels.get("function") in functions:
                counts[sample.labels.get("kind", "")] += int(sample.value)
    return dict(counts)


def list_cli_s(url: str, api_key: str, home: Path) -> float:
    """`lorafaas list` as a user runs it: a new process each time (median of 3)."""
    env = {**os.environ, "LORAFAAS_URL": url, "LORAFAAS_API_KEY": api_key}
    command = [sys.executable, "-m", "lorafaas", "--home", str(home), "list"]
    return median_s(lambda: subprocess.run(command, env=env, capture_output=True, check=True, timeout=120))


def listening_pid(url: str) -> int | None:
    """The pid of this machine's process listening on the URL's port, where there is one of ours."""
    import psutil

    port = httpx.URL(url).port or 80
    try:
        for connection in psutil.net_connections(kind="tcp"):
            if connection.status == psutil.CONN_LISTEN and connection.laddr and connection.laddr.port == port:
                return connection.pid
    except psutil.AccessDenied:
        return None
    return None


def shown_config(config: FleetConfig) -> FleetConfig:
    return msgspec.structs.replace(config, api_key=shown_key(config.api_key))


def names_of(adapters: Sequence[Path]) -> list[str]:
    return [adapter.name for adapter in adapters]


def deploy_lorafaas(client: ApiClient, adapters: list[Path], config: FleetConfig, progress: ProgressSink
                    ) -> tuple[list[str], float]:
    """(why each refused entry was, seconds) of deploying the fleet; a name already deployed is an error first."""
    taken = {spec.name for spec in client.list()} & set(names_of(adapters))
    if taken:
        raise ValueError(f"{len(taken)} of the fleet's functions ({sorted(taken)[0]}, ...) are deployed already "
                         "(a run that did not finish?): delete them, or give another --prefix")
    refused, deploy_s = deploy_batches(client, adapters, {"backbone": config.backbone}, config.batch_size, progress)
    return [f"{entry['name']}: {entry['message']}" for entry in refused], deploy_s


def delete_lorafaas(client: ApiClient, adapters: list[Path], progress: ProgressSink) -> None:
    """Delete the fleet's functions that were deployed."""
    deployed = sorted({spec.name for spec in client.list()} & set(names_of(adapters)))
    progress.stage(f"deleting the {len(deployed)} functions", total=len(deployed))
    for name in deployed:
        client.delete(name)
        progress.advance()


def silent() -> ProgressSink:
    return SilentProgress()
