"""Live comparisons of the scheduler's mechanisms, each policy on a fresh platform in a scratch home, same run.

`lorafaas bench batching`: a bursty workload on the three demo functions, adaptive batching vs batch size 1. One
warm-up request per function, then `bursts` bursts of `burst_size` concurrent streaming requests spread over the
three functions, `gap_s` apart. Per policy: requests per second over the bursts' makespan, the fraction of requests
whose time to first token met the function's TTFT SLO, mean and p99 TTFT.

`lorafaas bench preload`: cold invocations with pre-loading on and off. The demo adapters are deployed with a short
keep-alive; each round invokes every function once after every instance has scaled to zero, so every invocation is a
cold start with nothing else running. Per policy: the mean and each cold invocation's time to first token.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec

from lorafaas.formats.model_store import ModelStore
from lorafaas.progress import ProgressSink, SilentProgress
from lorafaas.sse import aevents
from lorafaas.stats import percentile
from lorafaas.testing.platform_process import PlatformProcess

DEMO_FUNCTIONS = ("pirate", "haiku", "french")
SETTLE_S = 8.0  # long enough for a backbone daemon to start or stop
PROMPTS = ("Tell me about the ocean.", "What do you like to do on weekends?", "Describe a forest at night.",
           "How do airplanes fly?", "Why is the sky blue?", "Tell me about the moon.")


class PolicyResult(msgspec.Struct, frozen=True, kw_only=True):
    requests: int
    errors: int
    makespan_s: float
    requests_per_s: float
    ttft_slo_attainment: float
    mean_ttft_s: float
    p99_ttft_s: float
    most_in_flight: dict[str, int]  # function -> most requests one instance held at once (the batches it ran)
    instances_started: dict[str, int]  # function -> cold starts during the run


class BatchingResult(msgspec.Struct, frozen=True, kw_only=True):
    slo_ttft_ms: int
    bursts: int
    burst_size: int
    max_tokens: int
    policies: dict[str, PolicyResult]
    ratio_requests_per_s: float  # adaptive over fixed-batch


def run_batching_bench(
    store: ModelStore, bursts: int = 3, burst_size: int = 24, gap_s: float = 10.0, max_tokens: int = 64,
    slo_ttft_ms: int = 2000, progress: ProgressSink | None = None,
) -> BatchingResult:
    progress = progress or SilentProgress()
    results = {}
    for policy in ("lorafaas", "fixed-batch"):
        progress.stage(f"{policy}: starting a platform with the demo functions (TTFT SLO {slo_ttft_ms} ms)")
        with scratch_platform(store, policy, demo=False) as platform:
            deploy_demo(platform, {"slo_ttft_ms": slo_ttft_ms})
            progress.stage(f"{policy}: {bursts} bursts of {burst_size} requests")
            results[policy] = asyncio.run(_drive(platform, bursts, burst_size, gap_s, max_tokens, slo_ttft_ms))
    return BatchingResult(
        slo_ttft_ms=slo_ttft_ms, bursts=bursts, burst_size=burst_size, max_tokens=max_tokens, policies=results,
        ratio_requests_per_s=round(results["lorafaas"].requests_per_s / results["fixed-batch"].requests_per_s, 2),
    )


def deploy_demo(platform: PlatformProcess, spec: dict) -> list[str]:
    """Deploy each demo adapter as a function of its name with `spec`; the names."""
    from lorafaas.platform.demo_functions import demo_adapter_dirs

    with platform.client() as client:
        for adapter in demo_adapter_dirs():
            client.deploy({"name": adapter.name, "backbone": "smollm2-135m", **spec}, adapter)
    return [adapter.name for adapter in demo_adapter_dirs()]


@contextlib.contextmanager
def scratch_platform(store: ModelStore, policy: str, demo: bool) -> Iterator[PlatformProcess]:
    """`lorafaas up --policy P` in a scratch home holding the store's smollm2-135m (no GGUF conversion)."""
    with tempfile.TemporaryDirectory(prefix="lorafaas-bench-") as scratch:
        home = Path(scratch)
        ModelStore(home / "models").import_dir("smollm2-135m", store.path("smollm2-135m"))
        args = ("--policy", policy, *(("--demo",) if demo else ()))
        with PlatformProcess(home, extra_args=args) as platform:
            yield platform


class PreloadResult(msgspec.Struct, frozen=True, kw_only=True):
    rounds: int
    keep_alive_s: float
    mean_cold_ttft_s: dict[str, float]  # policy -> mean
    cold_ttft_s: dict[str, list[float]]  # policy -> every cold invocation
    ratio_off_over_on: float


def run_preload_bench(store: ModelStore, rounds: int = 2, keep_alive_s: float = 2.0,
                      progress: ProgressSink | None = None) -> PreloadResult:
    progress = progress or SilentProgress()
    samples: dict[str, list[float]] = {}
    for policy in ("lorafaas", "no-preload"):
        progress.stage(f"{policy}: deploying the demo adapters with a {keep_alive_s:g} s keep-alive")
        with scratch_platform(store, policy, demo=False) as platform, platform.client() as client:
            names = deploy_demo(platform, {"keep_alive_s": keep_alive_s})
            time.sleep(SETTLE_S)  # let each policy do what it does ahead of requests (or not)
            progress.stage(f"{policy}: {rounds} rounds of cold invocations", rounds * len(names))
            samples[policy] = []
            for _ in range(rounds):
                for name in names:
                    _wait_until_scaled_to_zero(client, names)
                    samples[policy].append(asyncio.run(_cold_ttft(platform, name)))
                    progress.advance()
    means = {policy: round(statistics.mean(values), 3) for policy, values in samples.items()}
    return PreloadResult(rounds=rounds, keep_alive_s=keep_alive_s, mean_cold_ttft_s=means,
                         cold_ttft_s={p: [round(v, 3) for v in vs] for p, vs in samples.items()},
                         ratio_off_over_on=round(means["no-preload"] / means["lorafaas"], 2))


def _wait_until_scaled_to_zero(client, names: list[str], timeout_s: float = 120.0) -> None:
    """Until no function has an instance: the next invocation is cold, and nothing holds the backbone for it."""
    if not scaled_to_zero(client, names, timeout_s, poll_s=0.2):
        raise TimeoutError(f"{names} did not scale to zero within {timeout_s} s")
    time.sleep(SETTLE_S)  # reconcile ticks: with pre-loading off, the unused backbone is unloaded now


def scaled_to_zero(client, names: list[str], timeout_s: float, poll_s: float) -> bool:
    """Whether every function in `names` had no instance left within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while any(client.describe(name)["instances"] for name in names):
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


async def _cold_ttft(platform: PlatformProcess, name: str) -> float:
    async with httpx.AsyncClient(base_url=platform.url, timeout=600,
                                 headers={"Authorization": f"Bearer {platform.admin_key}"}) as http:
        ttft = await _one(http, name, PROMPTS[0], 4)
    if ttft is None:
        raise RuntimeError(f"the cold invocation of {name} failed")
    return ttft


async def _drive(platform: PlatformProcess, bursts: int, burst_size: int, gap_s: float, max_tokens: int,
                 slo_ttft_ms: int) -> PolicyResult:
    headers = {"Authorization": f"Bearer {platform.admin_key}"}
    async with httpx.AsyncClient(base_url=platform.url, headers=headers, timeout=600) as http:
        for name in DEMO_FUNCTIONS:  # warm: the comparison is about batching, not cold starts
            await _one(http, name, PROMPTS[0], max_tokens)
        started = time.perf_counter()
        jobs = []
        for burst in range(bursts):
            await asyncio.sleep(max(0.0, started + burst * gap_s - time.perf_counter()))
            jobs += [asyncio.create_task(_one(http, DEMO_FUNCTIONS[i % 3], PROMPTS[(burst + i) % len(PROMPTS)],
                                              max_tokens)) for i in range(burst_size)]
        outcomes = await asyncio.gather(*jobs)
        makespan = time.perf_counter() - started
        described = {name: (await http.get(f"/v1/functions/{name}")).json() for name in DEMO_FUNCTIONS}
    ttfts = [t for t in outcomes if t is not None]
    return PolicyResult(
        requests=len(outcomes), errors=len(outcomes) - len(ttfts), makespan_s=round(makespan, 2),
        requests_per_s=round(len(ttfts) / makespan, 3),
        ttft_slo_attainment=round(sum(t <= slo_ttft_ms / 1e3 for t in ttfts) / len(outcomes), 3),
        mean_ttft_s=round(statistics.mean(ttfts), 3) if ttfts else float("nan"),
        p99_ttft_s=round(percentile(ttfts, 99, math.nan), 3),
        most_in_flight={name: d["batching"]["most_in_flight"] for name, d in described.items()},
        instances_started={name: sum(d["cold_starts"].values()) for name, d in described.items()},
    )


async def _one(http: httpx.AsyncClient, name: str, prompt: str, max_tokens: int) -> float | None:
    """Stream one request to its end; its time to first token, or None if it failed."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True}
    started = time.perf_counter()
    ttft = None
    async with http.stream("POST", f"/v1/functions/{name}/invoke", json=body) as reply:
        if reply.status_code != 200:
            return None
        async for sse in aevents(reply):
            if sse.data is not None:
                event = sse.data
                if event.get("type") == "token" and ttft is None:
                    ttft = time.perf_counter() - started
                elif "error" in event:
                    return None
    return ttft
