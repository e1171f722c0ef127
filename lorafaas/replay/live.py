"""Live replay: drive a running platform with a workload over HTTP (httpx, async, streaming) and record each request.

Each request is sent at its scheduled time (a bounded number in flight: `max_in_flight`; a request held back counts
its wait in TTFT and E2E, which are measured from the scheduled time) as a streaming invocation whose prompt has
about `prompt_tokens` tokens and `max_tokens` = the trace's output length (clipped). TTFT = first `token` event, E2E =
`done` event. A poller reads `GET /v1/functions/{name}` every `poll_s` and keeps every instance it saw with its start
time and cold-start breakdown; afterwards each instance start is attributed to the earliest request of the function
that was waiting when it started: that request is a cold start (its breakdown is the instance's).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from lorafaas.errors import InvalidInput, PlatformUnavailable
from lorafaas.replay.results import RequestResult
from lorafaas.replay.workload import Request, Workload
from lorafaas.sse import aevents

log = logging.getLogger(__name__)

PROMPT_WORDS = ("the", "ocean", "ship", "wind", "sail", "island", "map", "gold", "star", "night", "storm", "crew")


@dataclass(frozen=True)
class LiveConfig:
    url: str
    api_key: str
    max_in_flight: int = 64
    poll_s: float = 1.0
    request_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise InvalidInput(f"max_in_flight is {self.max_in_flight}; it must be >= 1")
        if self.poll_s <= 0:
            raise InvalidInput(f"poll_s is {self.poll_s}; it must be > 0")


@dataclass
class InstanceSeen:
    instance_id: str
    function: str
    started_at: float  # wall clock (time.time) of the platform host
    cold_start: dict[str, float] = field(default_factory=dict)


@dataclass
class LiveRun:
    results: list[RequestResult]
    instances: dict[str, InstanceSeen]
    started_wall: float
    wall_s: float
    busy_peak: int | None = None  # the most instances busy at once on a device (`/metrics`), None: not readable
    compute_slots: int | None = None
    computing_peak: int | None = None  # the most instances running an engine step at once (the step gate's grants)


def prompt_text(num_tokens: int) -> str:
    """About `num_tokens` tokens of plain words (one short common word is one token for BPE tokenizers)."""
    words = [PROMPT_WORDS[i % len(PROMPT_WORDS)] for i in range(max(1, num_tokens - 8))]
    return "Continue this list: " + " ".join(words)


async def _poll_instances(
    client: httpx.AsyncClient,
    functions: Sequence[str],
    seen: dict[str, InstanceSeen],
    stop: asyncio.Event,
    poll_s: float,
) -> None:
    while True:
        await _poll_once(client, functions, seen)
        try:
            await asyncio.wait_for(stop.wait(), poll_s)
            await _poll_once(client, functions, seen)
            return
        except asyncio.TimeoutError:
            continue


async def _poll_once(client: httpx.AsyncClient, functions: Sequence[str], seen: dict[str, InstanceSeen]) -> None:
    for name in functions:
        try:
            response = await client.get(f"/v1/functions/{name}")
        except httpx.TransportError as exc:
            log.debug("describe %s failed: %s", name, exc)
            continue
        if response.status_code != 200:
            continue
        for inst in response.json().get("instances", []):
            iid = inst.get("instance_id")
            if iid is None or inst.get("started_at") is None:
                continue
            entry = seen.setdefault(iid, InstanceSeen(iid, name, float(inst["started_at"])))
            if inst.get("cold_start"):
                entry.cold_start = {k: float(v) for k, v in inst["cold_start"].items()}


def attribute_cold_starts(
    results: Sequence[RequestResult], instances: dict[str, InstanceSeen], started_wall: float, slack_s: float = 0.05
) -> None:
    """Mark the request each instance start served: the earliest of its function sent by the start and still
    without a first token then. Requests of functions the poller saw are marked warm otherwise."""
    by_function: dict[str, list[RequestResult]] = {}
    for r in results:
        if r.sent_s is not None:
            by_function.setdefault(r.function, []).append(r)
    for function, rs in by_function.items():
        rs.sort(key=lambda r: r.sent_s or 0.0)
        for r in rs:
            r.cold = False
        for inst in sorted((i for i in instances.values() if i.function == function), key=lambda i: i.started_at):
            t = inst.started_at - started_wall
            for r in rs:
                if r.cold or r.sent_s is None or r.sent_s > t + slack_s:
                    continue
                first = r.arrival_s + r.ttft_s if r.ttft_s is not None else float("inf")
                if first >= t:
                    r.cold = True
                    r.cold_start_s = inst.cold_start.get("total")
                    break


async def _invoke(
    client: httpx.AsyncClient, req: Request, result: RequestResult, t0: float, gate: asyncio.Semaphore
) -> None:
    async with gate:
        body = {
            "messages": [{"role": "user", "content": prompt_text(req.prompt_tokens)}],
            "max_tokens": req.output_tokens,
            "stream": True,
        }
        result.sent_s = time.perf_counter() - t0
        try:
            async with client.stream("POST", f"/v1/functions/{req.function}/invoke", json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    result.error = f"HTTP {response.status_code}: {text[:200]}"
                    return
                async for sse in aevents(response):
                    now = time.perf_counter() - t0
                    event = sse.data or {}
                    if sse.error is not None:
                        result.error = f"stream error: {str(event)[:200]}"
                        return
                    if event.get("type") == "token" and result.ttft_s is None:
                        result.ttft_s = now - req.arrival_s
                    elif event.get("type") == "done":
                        result.e2e_s = now - req.arrival_s
                        usage = event.get("usage") or {}
                        result.completion_tokens = int(usage.get("completion_tokens", 0))
                        result.usage_prompt_tokens = usage.get("prompt_tokens")
                        if result.ttft_s is None:
                            result.ttft_s = result.e2e_s
                        return
            result.error = result.error or "the stream ended without a done event"
        except httpx.HTTPError as exc:
            result.error = f"{type(exc).__name__}: {exc}"[:200]


async def run_live(
    workload: Workload, config: LiveConfig, on_progress: Callable[[int, int], None] | None = None
) -> LiveRun:
    """Replay `workload` in real time against the platform at `config.url`."""
    requests = workload.requests
    results = [
        RequestResult(i, r.function, r.trace_function, r.arrival_s, r.prompt_tokens, r.output_tokens)
        for i, r in enumerate(requests)
    ]
    headers = {"Authorization": f"Bearer {config.api_key}"}
    timeout = httpx.Timeout(config.request_timeout_s, connect=10.0)
    limits = httpx.Limits(max_connections=config.max_in_flight + 4, max_keepalive_connections=config.max_in_flight)
    async with httpx.AsyncClient(base_url=config.url, headers=headers, timeout=timeout, limits=limits) as client:
        try:
            ready = await client.get("/readyz")
        except httpx.TransportError as exc:
            raise PlatformUnavailable(f"no lorafaas gateway answers at {config.url}: {exc}") from exc
        if ready.status_code != 200:
            raise PlatformUnavailable(f"{config.url}/readyz answered {ready.status_code}; the platform is not ready")
        for name in workload.functions:
            described = await client.get(f"/v1/functions/{name}")
            if described.status_code != 200:
                raise InvalidInput(
                    f"function {name!r} (a mapping target) is not deployed at {config.url}: "
                    f"HTTP {described.status_code}"
                )
        instances: dict[str, InstanceSeen] = {}
        stop = asyncio.Event()
        poller = asyncio.create_task(_poll_instances(client, workload.functions, instances, stop, config.poll_s))
        gate = asyncio.Semaphore(config.max_in_flight)
        started_wall, t0 = time.time(), time.perf_counter()
        done = 0

        def finished(_: asyncio.Task) -> None:
            nonlocal done
            done += 1
            if on_progress:
                on_progress(done, len(requests))

        tasks = []
        for req, result in zip(requests, results, strict=True):
            delay = req.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(_invoke(client, req, result, t0, gate))
            task.add_done_callback(finished)
            tasks.append(task)
        await asyncio.gather(*tasks)
        wall_s = time.perf_counter() - t0
        stop.set()
        await poller
        peaks = await _device_peaks(client)
    attribute_cold_starts(results, instances, started_wall)
    return LiveRun(results, instances, started_wall, wall_s, peaks.get("lorafaas_busy_instances_peak"),
                   peaks.get("lorafaas_compute_slots"), peaks.get("lorafaas_computing_instances_peak"))


DEVICE_PEAKS = ("lorafaas_busy_instances_peak", "lorafaas_compute_slots", "lorafaas_computing_instances_peak")


async def _device_peaks(client: httpx.AsyncClient) -> dict[str, int]:
    """The platform's DEVICE_PEAKS (each the largest over its devices); a name is missing where `/metrics` does not
    show it (another server, no step gate, or a key not allowed to read it)."""
    try:
        reply = await client.get("/metrics")
    except httpx.TransportError:
        return {}
    if reply.status_code != 200:
        return {}
    found: dict[str, int] = {}
    for family in text_string_to_metric_families(reply.text):
        if family.name in DEVICE_PEAKS and family.samples:
            found[family.name] = int(max(sample.value for sample in family.samples))
    return found
