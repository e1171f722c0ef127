"""Traffic and soak runs against a real platform on loopback (the three demo functions on smollm2-135m).

`lorafaas bench traffic`: `clients` closed-loop streaming clients for `duration_s`, each calling the demo functions in
turn. Every request must end with exactly one `done` event whose text is the concatenation of its token events and
whose token count is the number of token events (nothing lost, nothing repeated on the way), and the platform's own
invocation counter must equal the number of requests sent (none run twice, none dropped). Reports requests/s and the
TTFT percentiles.

`lorafaas bench soak`: cycles of a short burst on every function followed by an idle period longer than the keep-alive
(the `fixed-keep-alive` policy), so every function scales to zero and back each cycle, for `duration_s`. Samples the
memory (RSS) of the platform process (gateway, controller and node agent) after each cycle; growth is the last sample
over the first (taken after one cycle, when imports, caches and pools exist). After the platform stops: the
shared-memory segments of its backbones and the processes it started that are left (both must be none).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import re
import time
from dataclasses import dataclass, field

import httpx
import msgspec
import psutil

from lorafaas.bench.live import (
    DEMO_FUNCTIONS,
    PROMPTS,
    deploy_demo,
    scaled_to_zero,
    scratch_platform,
)
from lorafaas.cuda_ipc.shm import list_segments
from lorafaas.formats.model_store import ModelStore
from lorafaas.progress import ProgressSink, SilentProgress
from lorafaas.protocols.daemon_config import DaemonPaths
from lorafaas.sse import aevents
from lorafaas.stats import percentile
from lorafaas.testing.platform_process import PlatformProcess


class TrafficResult(msgspec.Struct, frozen=True, kw_only=True):
    clients: int
    duration_s: float
    max_tokens: int
    requests_sent: int
    responses_complete: int
    lost: int  # sent, but no complete and consistent response
    duplicated: int  # invocations the platform counted beyond the requests sent
    errors: list[str]  # the first few failures, verbatim
    invocations_counted: int  # the platform's lorafaas_invocations_total during the run
    requests_per_s: float
    p50_ttft_s: float
    p99_ttft_s: float


class SoakResult(msgspec.Struct, frozen=True, kw_only=True):
    duration_s: float
    keep_alive_s: float
    cycles: int
    requests: int
    failed_requests: int
    errors: list[str]  # the first few failures, verbatim
    cycles_scaled_to_zero: int  # cycles after which no function had an instance left
    platform_rss_mb: list[float]  # after each cycle
    platform_rss_growth: float  # last / first - 1
    leaked_segments: list[str]
    leaked_processes: list[str]


@dataclass
class _Tally:
    sent: int = 0
    complete: int = 0
    ttfts: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    counted_before: int = 0  # the platform's invocation count when the run started

    def fail(self, message: str) -> None:
        if len(self.errors) < 5:
            self.errors.append(message)


def run_traffic_bench(store: ModelStore, clients: int = 20, duration_s: float = 300.0, max_tokens: int = 16,
                      progress: ProgressSink | None = None) -> TrafficResult:
    progress = progress or SilentProgress()
    progress.stage("starting a platform with the demo functions")
    with scratch_platform(store, "lorafaas", demo=False) as platform:
        deploy_demo(platform, {})
        progress.stage(f"{clients} clients for {duration_s:g} s", int(duration_s))
        tally = asyncio.run(_load(platform, clients, duration_s, max_tokens, progress))
        counted = _invocations_counted(platform) - tally.counted_before
    return TrafficResult(
        clients=clients, duration_s=duration_s, max_tokens=max_tokens, requests_sent=tally.sent,
        responses_complete=tally.complete, lost=tally.sent - tally.complete,
        duplicated=max(0, counted - tally.sent), errors=tally.errors, invocations_counted=counted,
        requests_per_s=round(tally.complete / duration_s, 3),
        p50_ttft_s=round(percentile(tally.ttfts, 50, math.nan), 3),
        p99_ttft_s=round(percentile(tally.ttfts, 99, math.nan), 3),
    )


async def _load(platform: PlatformProcess, clients: int, duration_s: float, max_tokens: int,
                progress: ProgressSink) -> _Tally:
    tally = _Tally()
    headers = {"Authorization": f"Bearer {platform.admin_key}"}
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=platform.url, headers=headers, timeout=600, limits=limits) as http:
        for name in DEMO_FUNCTIONS:  # one cold start each before the clock starts
            await _checked_request(http, name, PROMPTS[0], max_tokens, _Tally())
        tally.counted_before = await asyncio.to_thread(_invocations_counted, platform)
        started = time.monotonic()
        deadline = started + duration_s

        async def client(index: int) -> None:
            for turn in itertools.count(index):
                if time.monotonic() >= deadline:
                    return
                tally.sent += 1
                await _checked_request(http, DEMO_FUNCTIONS[turn % 3], PROMPTS[turn % len(PROMPTS)], max_tokens,
                                       tally)

        async def tick() -> None:
            while time.monotonic() < deadline:
                await asyncio.sleep(1.0)
                progress.advance(1)

        ticker = asyncio.create_task(tick())
        await asyncio.gather(*(client(i) for i in range(clients)))
        ticker.cancel()
    return tally


async def _checked_request(http: httpx.AsyncClient, name: str, prompt: str, max_tokens: int, tally: _Tally) -> bool:
    """One streaming request, checked end to end; counted complete only if its stream is whole and consistent."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True}
    started = time.perf_counter()
    ttft, texts, done = None, [], []
    try:
        async with http.stream("POST", f"/v1/functions/{name}/invoke", json=body) as reply:
            if reply.status_code != 200:
                tally.fail(f"{name}: HTTP {reply.status_code} {(await reply.aread())[:200]!r}")
                return False
            async for sse in aevents(reply):
                event = sse.data or {}
                if event.get("type") == "token":
                    ttft = ttft if ttft is not None else time.perf_counter() - started
                    texts.append(event["text"])
                elif event.get("type") == "done":
                    done.append(event)
                else:
                    tally.fail(f"{name}: {event}")
                    return False
    except httpx.HTTPError as exc:
        tally.fail(f"{name}: {type(exc).__name__}: {exc}")
        return False
    if len(done) != 1:
        tally.fail(f"{name}: {len(done)} done events")
        return False
    # Every generated token is streamed, an end-of-sequence token too (which the count leaves out).
    tokens, finish = done[0]["usage"]["completion_tokens"], done[0]["finish_reason"]
    if len(texts) not in (tokens, tokens + (finish == "stop")) or "".join(texts) != done[0]["text"]:
        tally.fail(f"{name}: {len(texts)} token events for {tokens} tokens; streamed {''.join(texts)!r}, "
                   f"done says {done[0]['text']!r}")
        return False
    tally.complete += 1
    if ttft is not None:
        tally.ttfts.append(ttft)
    return True


def _invocations_counted(platform: PlatformProcess) -> int:
    text = httpx.get(f"{platform.url}/metrics", headers={"Authorization": f"Bearer {platform.admin_key}"}).text
    return int(sum(float(v) for v in re.findall(r"^lorafaas_invocations_total\{[^}]*\} (\S+)$", text, re.M)))


def run_soak_bench(store: ModelStore, duration_s: float = 1800.0, keep_alive_s: float = 5.0, burst: int = 6,
                   max_tokens: int = 8, progress: ProgressSink | None = None) -> SoakResult:
    progress = progress or SilentProgress()
    progress.stage(f"starting a platform with the demo functions (keep-alive {keep_alive_s:g} s)")
    # The fixed keep-alive: the hybrid policy would learn the regular idle gaps and keep the instances warm across
    # them, which is right in production but would stop the scale-to-zero this run exercises.
    with scratch_platform(store, "fixed-keep-alive", demo=False) as platform:
        names = deploy_demo(platform, {"keep_alive_s": keep_alive_s})
        main = psutil.Process(platform.pid)
        started = time.monotonic()
        progress.stage(f"bursts and scale-to-zero for {duration_s:g} s", int(duration_s))
        rss: list[float] = []
        errors: list[str] = []
        cycles, requests, failed, to_zero, children, shown = 0, 0, 0, 0, set(), 0.0
        with platform.client() as client:
            while time.monotonic() - started < duration_s:
                tally = asyncio.run(_burst(platform, names, burst, max_tokens))
                requests, failed = requests + tally.sent, failed + tally.sent - tally.complete
                errors += tally.errors[: 5 - len(errors)]
                children |= {(p.pid, " ".join(p.cmdline()[:4])) for p in _children(main)}
                to_zero += scaled_to_zero(client, names, keep_alive_s * 6, poll_s=0.5)
                cycles += 1
                rss.append(round(main.memory_info().rss / 2**20, 1))
                progress.advance(time.monotonic() - started - shown)
                shown = time.monotonic() - started
        home = platform.home
    leaked_processes = [f"{pid} {cmd}" for pid, cmd in sorted(children) if psutil.pid_exists(pid)
                        and _same_process(pid, cmd)]
    leaked_segments = list_segments(DaemonPaths.of(home, "smollm2-135m", "cpu").segment_prefix)
    return SoakResult(
        duration_s=duration_s, keep_alive_s=keep_alive_s, cycles=cycles, requests=requests, failed_requests=failed,
        errors=errors,
        cycles_scaled_to_zero=to_zero, platform_rss_mb=rss,
        platform_rss_growth=round(rss[-1] / rss[0] - 1, 4) if rss else float("nan"),
        leaked_segments=leaked_segments, leaked_processes=leaked_processes,
    )


async def _burst(platform: PlatformProcess, names: list[str], burst: int, max_tokens: int) -> _Tally:
    tally = _Tally()
    headers = {"Authorization": f"Bearer {platform.admin_key}"}
    async with httpx.AsyncClient(base_url=platform.url, headers=headers, timeout=600) as http:
        tally.sent = burst * len(names)
        await asyncio.gather(*(_checked_request(http, name, PROMPTS[i % len(PROMPTS)], max_tokens, tally)
                               for i in range(burst) for name in names))
    return tally


def _children(process: psutil.Process) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return process.children(recursive=True)
    return []


def _same_process(pid: int, cmd: str) -> bool:
    """The pid still runs the command it ran (and was not reused by another process)."""
    with contextlib.suppress(psutil.Error):
        return " ".join(psutil.Process(pid).cmdline()[:4]) == cmd
    return False
