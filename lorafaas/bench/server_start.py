"""`lorafaas bench server-start`: from launching a server to its first token, for any OpenAI-compatible server.

A sample launches the server's command (a new session, its output to a log file), then sends one streaming
completion to the model every `poll_s` until one answers with text: `first_token_s` is the time from the launch to
that text. Refused connections and error answers while the server starts count as "not yet". The server's process
tree is then stopped (SIGTERM to the server, SIGKILL to whatever of its tree is left after `stop_grace_s`) before the
next sample, so every sample is a cold start of the whole server. Targets alternate sample by sample (A B, B A, ...),
each after a pause (`settle_s`).

    lorafaas   `lorafaas --home H up --demo --port P` on a home where the backbone is imported: gateway, agent,
               backbone daemon, then the first request starts the function's instance
    vllm       `scripts/vllm-cpu.sh --port P`: the engine, the model and every --lora-modules adapter, then the request
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import msgspec
import psutil

from lorafaas.bench.serve import ServeBenchConfig, Target, make_prompts, one_request
from lorafaas.bench.serve_stats import process_tree
from lorafaas.progress import ProgressSink, SilentProgress


class ServerStartTarget(msgspec.Struct, frozen=True, kw_only=True):
    label: str
    url: str  # base URL, without /v1
    model: str  # the model (function or adapter) the first request names
    command: tuple[str, ...]  # argv that starts the server in the foreground


class ServerStartConfig(msgspec.Struct, frozen=True, kw_only=True):
    repeats: int = 3
    output_len: int = 16
    prompt_len: int = 32
    api_key: str | None = None
    timeout_s: float = 600.0  # the longest one start may take to its first token
    poll_s: float = 0.25
    settle_s: float = 3.0
    stop_grace_s: float = 60.0
    log_dir: str = "."  # each sample's server output: LABEL-K.log


class ServerStartSample(msgspec.Struct, frozen=True, kw_only=True):
    label: str
    first_token_s: float  # launch to the first token of the first request answered
    attempts: int  # requests sent until one answered (the first ones while the server was starting)
    stop_s: float  # SIGTERM to the whole tree gone
    log: str


class ServerStartSummary(msgspec.Struct, frozen=True, kw_only=True):
    label: str
    median_first_token_s: float
    min_first_token_s: float
    max_first_token_s: float


class ServerStartResult(msgspec.Struct, frozen=True, kw_only=True):
    config: ServerStartConfig
    targets: tuple[ServerStartTarget, ...]
    samples: tuple[ServerStartSample, ...]
    summaries: tuple[ServerStartSummary, ...]


def run_server_start_bench(targets: Sequence[ServerStartTarget], config: ServerStartConfig,
                           progress: ProgressSink | None = None) -> ServerStartResult:
    labels = [t.label for t in targets]
    if not targets or len(set(labels)) != len(labels):
        raise ValueError(f"targets {labels}: give one or more, each with its own label")
    Path(config.log_dir).mkdir(parents=True, exist_ok=True)
    return asyncio.run(_run(list(targets), config, progress or SilentProgress()))


async def _run(targets: list[ServerStartTarget], config: ServerStartConfig, progress: ProgressSink
               ) -> ServerStartResult:
    prompt = make_prompts(1, config.prompt_len, seed=0)[0]
    samples: list[ServerStartSample] = []
    progress.stage("server starts", total=config.repeats * len(targets))
    for k in range(config.repeats):
        for target in targets if k % 2 == 0 else reversed(targets):  # a drift falls on every target alike
            await asyncio.sleep(config.settle_s)
            samples.append(await _sample(target, k, config, prompt))
            progress.advance()
    summaries = tuple(
        ServerStartSummary(label=t.label, median_first_token_s=statistics.median(times),
                           min_first_token_s=min(times), max_first_token_s=max(times))
        for t in targets if (times := [s.first_token_s for s in samples if s.label == t.label]))
    return ServerStartResult(config=config, targets=tuple(targets), samples=tuple(samples), summaries=summaries)


async def _sample(target: ServerStartTarget, k: int, config: ServerStartConfig, prompt: str) -> ServerStartSample:
    log = Path(config.log_dir) / f"{target.label}-{k + 1}.log"
    request = ServeBenchConfig(models=(target.model,), concurrencies=(1,), requests=1, output_len=config.output_len,
                               api_key=config.api_key, timeout_s=config.timeout_s)
    with log.open("wb") as out:
        launched = time.perf_counter()
        try:
            server = subprocess.Popen(target.command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True)
        except OSError as exc:
            raise RuntimeError(f"{target.label}: cannot run {target.command[0]!r}: {exc}") from None
        try:
            attempts, last_error = 0, "no request sent"
            async with httpx.AsyncClient(timeout=config.timeout_s) as http:
                while True:
                    if server.poll() is not None:
                        raise RuntimeError(f"{target.label}: the server exited with code {server.returncode} before "
                                           f"a first token (last answer: {last_error}); its output is in {log}")
                    if time.perf_counter() - launched > config.timeout_s:
                        raise RuntimeError(f"{target.label}: no first token within {config.timeout_s:.0f} s (last "
                                           f"answer: {last_error}); its output is in {log}")
                    attempts += 1
                    outcome = await one_request(http, Target(label=target.label, url=target.url), target.model,
                                                prompt, request)
                    if outcome.ok:
                        first_token_s = time.perf_counter() - launched - (outcome.latency_s - outcome.ttft_s)
                        break
                    last_error = outcome.error
                    await asyncio.sleep(config.poll_s)
        finally:
            stop_s = _stop_tree(server, config.stop_grace_s)
    return ServerStartSample(label=target.label, first_token_s=first_token_s, attempts=attempts, stop_s=stop_s,
                             log=str(log))


def _stop_tree(server: subprocess.Popen, grace_s: float) -> float:
    """SIGTERM the server and give it `grace_s` to stop what it started; then SIGKILL whatever of its tree is left
    (children that began sessions of their own included, which a process-group signal would miss)."""
    started = time.perf_counter()
    tree = process_tree(server.pid)
    if not tree:
        server.wait()
        return 0.0
    with contextlib.suppress(psutil.NoSuchProcess):
        tree[0].terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.wait(timeout=grace_s)
    for process in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(tree, timeout=10)
    server.wait()
    return time.perf_counter() - started
