"""`lorafaas bench throughput`: one function's generation throughput at 1 and at N concurrent requests, same run.

The same N greedy requests (distinct prompts, exactly `max_tokens` each: end-of-sequence is ignored, as in vLLM's
throughput benchmark, so that the figure measures batching rather than how unevenly the prompts happen to end) are
sent to one pre-loaded instance twice: one at a time, then all at once (continuous batching). Throughput is completion
tokens per second of wall time; the outputs of the concurrent run must equal the one-at-a-time outputs token for
token.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec

from lorafaas.function_runtime import messages as m
from lorafaas.platform.backends.local import LocalLauncher
from lorafaas.progress import ProgressSink, SilentProgress

PROMPTS = (
    "Tell me about the ocean.",
    "What do you like to do on weekends?",
    "Describe a forest at night.",
    "How do airplanes fly?",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "What is the best way to learn a language?",
    "Write a short story about a lighthouse.",
    "Explain how a rainbow forms.",
    "What makes a good friend?",
    "Describe the city of Paris.",
    "How do bees make honey?",
    "What is your favourite season and why?",
    "Tell me about the moon.",
    "How does a bicycle work?",
    "What should I pack for a trip to the mountains?",
)


class ThroughputResult(msgspec.Struct, frozen=True, kw_only=True):
    backbone: str
    adapter: str
    num_requests: int
    max_tokens: int
    tokens_per_s_at_1: float
    tokens_per_s_at_n: float
    ratio_n_over_1: float
    completion_tokens: int
    outputs_identical: bool


def run_throughput_bench(
    home: Path, backbone: str, adapter_dir: Path, concurrency: int = 8, max_tokens: int = 64,
    progress: ProgressSink | None = None,
) -> ThroughputResult:
    progress = progress or SilentProgress()
    if not 1 < concurrency <= len(PROMPTS):
        raise ValueError(f"concurrency is {concurrency}; it must lie between 2 and {len(PROMPTS)}")
    prompts = PROMPTS[:concurrency]
    with LocalLauncher(home) as launcher:
        progress.stage("starting one pre-loaded instance")
        instance = launcher.launch(launcher.spec("bench", backbone, adapter_dir, max_batch_size=concurrency))
        progress.stage(f"{concurrency} requests one at a time, then all at once")
        sequential, concurrent = asyncio.run(_measure(instance, prompts, max_tokens))
    (seq_s, seq_outputs), (con_s, con_outputs) = sequential, concurrent
    tokens = sum(len(ids) for ids in seq_outputs)
    return ThroughputResult(
        backbone=backbone,
        adapter=Path(adapter_dir).name,
        num_requests=concurrency,
        max_tokens=max_tokens,
        tokens_per_s_at_1=round(tokens / seq_s, 2),
        tokens_per_s_at_n=round(sum(len(ids) for ids in con_outputs) / con_s, 2),
        ratio_n_over_1=round(seq_s / con_s * sum(len(ids) for ids in con_outputs) / tokens, 2),
        completion_tokens=tokens,
        outputs_identical=seq_outputs == con_outputs,
    )


async def _measure(instance, prompts: tuple[str, ...], max_tokens: int):
    async with await instance.connect() as worker:
        for stage in m.STAGES:
            await worker.stage(stage)

        async def one(request_id: str, prompt: str) -> list[int]:
            request = m.Generate(request_id=request_id, messages=(m.ChatMessage("user", prompt),),
                                 params=m.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            return [e.token_id async for e in worker.generate(request) if isinstance(e, m.Token)]

        started = time.perf_counter()
        sequential = [await one(f"seq-{i}", p) for i, p in enumerate(prompts)]
        sequential_s = time.perf_counter() - started
        started = time.perf_counter()
        concurrent = list(await asyncio.gather(*(one(f"con-{i}", p) for i, p in enumerate(prompts))))
        concurrent_s = time.perf_counter() - started
    return (sequential_s, sequential), (concurrent_s, concurrent)
