"""`lorafaas bench serve`: a serving benchmark against any OpenAI-compatible server (lorafaas, vLLM, ...).

Like vLLM's `benchmark_serving`: streaming `/v1/completions` on raw prompts, spread round-robin over the models
(functions, or vLLM's LoRA modules), `requests` per concurrency level with at most `concurrency` in flight. Several
targets are measured in one run, A/B alternated: at each level every target runs once, the order reversed from one
level to the next, so a drift in the machine's load falls on both. Every target gets the same seeded prompts.

Output tokens are the server's own count (`stream_options.include_usage`); a server that does not send usage is
counted one token per streamed text chunk.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence

import httpx
import msgspec

from lorafaas.bench.serve_stats import LevelResult, LoadProbe, RequestOutcome, summarize
from lorafaas.progress import ProgressSink, SilentProgress
from lorafaas.sse import aevents

# Short, common English words: each is one token (with its leading space) in the BPE vocabularies of the usual small
# models (SmolLM2, Llama, Qwen), so a prompt of N words is close to N tokens; the server's own count is reported.
_WORDS = (
    "the of and to in is it you that he was for on are with as his they be at one have this from or had by hot but"
    " some what there we can out other were all your when up use word how said an each she which do their time if"
    " will way about many then them would write like so these her long make thing see him two has look more day"
    " could go come did my sound no most number who over know water than call first people may down side been now"
    " find any new work part take get place made live where after back little only round man year came show every"
    " good me give our under name very through just form much great think say help low line before turn cause same"
    " mean differ move right boy old too does tell sentence set three want air well also play small end put home"
    " read hand port large spell add even land here must big high such follow act why ask men change went light"
)


class Target(msgspec.Struct, frozen=True, kw_only=True):
    label: str
    url: str  # base URL, without /v1
    server_pid: int | None = None


class ServeBenchConfig(msgspec.Struct, frozen=True, kw_only=True):
    models: tuple[str, ...]
    concurrencies: tuple[int, ...]
    requests: int
    output_len: int = 64
    prompt_len: int = 32
    prompts: int = 64  # distinct seeded prompts, reused in turn
    seed: int = 0
    ignore_eos: bool = False
    api_key: str | None = None
    warmup: bool = True  # one request per model and target before the first level, not counted
    timeout_s: float = 600.0


class ServeBenchResult(msgspec.Struct, frozen=True, kw_only=True):
    config: ServeBenchConfig
    targets: tuple[Target, ...]
    levels: tuple[LevelResult, ...]  # in the order they ran


def make_prompts(count: int, length: int, seed: int) -> list[str]:
    """`count` prompts of `length` words drawn with `seed`: the same on every run and for every target."""
    rng = random.Random(seed)
    words = _WORDS.split()
    return [" ".join(rng.choice(words) for _ in range(length)) for _ in range(count)]


def parse_target(spec: str, index: int) -> Target:
    """`URL` or `label=URL`; the label defaults to the URL's host:port."""
    label, sep, url = spec.partition("=")
    if not sep or "://" in label:
        label, url = "", spec
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--url {spec!r}: expected http(s)://host:port or label=http(s)://host:port")
    url = url.rstrip("/").removesuffix("/v1")
    return Target(label=label or httpx.URL(url).netloc.decode() or f"target{index}", url=url)


async def one_request(http: httpx.AsyncClient, target: Target, model: str, prompt: str,
                      config: ServeBenchConfig) -> RequestOutcome:
    """Send one streaming completion and time it: TTFT at the first chunk carrying text."""
    body: dict = {"model": model, "prompt": prompt, "max_tokens": config.output_len, "temperature": 0.0,
                  "stream": True, "stream_options": {"include_usage": True}}
    if config.ignore_eos:
        body["ignore_eos"] = True  # vLLM's extra sampling field; a server that does not know it may ignore it
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    start = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    chunks = 0
    usage: dict | None = None
    try:
        async with http.stream("POST", f"{target.url}/v1/completions", json=body, headers=headers) as reply:
            if reply.status_code != 200:
                await reply.aread()
                return _failed(model, f"HTTP {reply.status_code}: {reply.text[:300]}")
            async for event in aevents(reply):
                document = event.data
                if document is None:  # the closing [DONE]
                    break
                if event.error is not None:
                    return _failed(model, f"error event: {json.dumps(event.error)[:300]}")
                usage = document.get("usage") or usage
                if any(choice.get("text") for choice in document.get("choices", ())):
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    elif last is not None:  # (set with first)
                        gaps.append(now - last)
                    last = now
                    chunks += 1
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: bad JSON in a data line, or httpx_sse's SSEError
        return _failed(model, f"{type(exc).__name__}: {exc}"[:300])
    end = time.perf_counter()
    if first is None:
        return _failed(model, "the stream ended without any text")
    tokens = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage else chunks
    prompt_tokens = int(usage["prompt_tokens"]) if usage and "prompt_tokens" in usage else None
    return RequestOutcome(model=model, ok=True, ttft_s=first - start, latency_s=end - start, output_tokens=tokens,
                          prompt_tokens=prompt_tokens, chunk_gaps_s=tuple(gaps))


def _failed(model: str, error: str) -> RequestOutcome:
    return RequestOutcome(model=model, ok=False, error=error)


async def run_level(http: httpx.AsyncClient, target: Target, concurrency: int, prompts: Sequence[str],
                    config: ServeBenchConfig, progress: ProgressSink) -> LevelResult:
    """`config.requests` requests, request i to model i mod len(models), at most `concurrency` in flight."""
    outcomes: list[RequestOutcome | None] = [None] * config.requests
    next_index = iter(range(config.requests))

    async def worker() -> None:
        for i in next_index:  # one shared iterator: each worker takes the next request when it is free
            model = config.models[i % len(config.models)]
            outcomes[i] = await one_request(http, target, model, prompts[i % len(prompts)], config)
            progress.advance()

    probe = LoadProbe(target.server_pid)
    probe.start()
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, config.requests))))
    duration = time.perf_counter() - start
    load = probe.stop()
    return summarize(target.label, target.url, concurrency, [o for o in outcomes if o is not None], duration, load,
                     config.output_len)


async def run_serve_bench_async(targets: Sequence[Target], config: ServeBenchConfig,
                                progress: ProgressSink | None = None) -> ServeBenchResult:
    progress = progress or SilentProgress()
    prompts = make_prompts(config.prompts, config.prompt_len, config.seed)
    limits = httpx.Limits(max_connections=max(config.concurrencies) + 4, max_keepalive_connections=None)
    levels = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(config.timeout_s, connect=30.0), limits=limits) as http:
        if config.warmup:
            for target in targets:
                progress.stage(f"{target.label}: warm-up, one request per model", len(config.models))
                for model in config.models:
                    outcome = await one_request(http, target, model, prompts[0], config)
                    if not outcome.ok:
                        raise RuntimeError(f"{target.label}: warm-up request to {model} failed: {outcome.error}")
                    progress.advance()
        for n, concurrency in enumerate(config.concurrencies):
            order = list(targets) if n % 2 == 0 else list(reversed(targets))  # A/B, then B/A
            for target in order:
                progress.stage(f"{target.label}: concurrency {concurrency}", config.requests)
                levels.append(await run_level(http, target, concurrency, prompts, config, progress))
    shown = msgspec.structs.replace(config, api_key=shown_key(config.api_key))
    return ServeBenchResult(config=shown, targets=tuple(targets), levels=tuple(levels))


def shown_key(api_key: str | None) -> str | None:
    """The key as a benchmark's result shows it: results get shared, so never the key, only whether one was sent."""
    return "<redacted>" if api_key else None


def run_serve_bench(targets: Sequence[Target], config: ServeBenchConfig,
                    progress: ProgressSink | None = None) -> ServeBenchResult:
    return asyncio.run(run_serve_bench_async(targets, config, progress))
