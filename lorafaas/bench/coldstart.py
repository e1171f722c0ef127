"""`lorafaas bench coldstart`: time to first token of one function, from a conventional process to a warm instance.

All measured in one run, each the median of `repeats` samples, every sample a new process (or a new request):

    standalone_ttft_s            a fresh process: imports, from_pretrained, PEFT adapter, first token
    cold_ttft_s                  a fresh lorafaas worker with nothing pre-loaded: start the interpreter, import,
                                 attach + bind the shared backbone, read + place the adapter, first token
    libraries_preloaded_ttft_s   a worker forked from the library pool (libraries and the backbone's tokenizer held
                                 there), then attach + bind, adapter, first token
    all_preloaded_ttft_s         an instance with every artifact pre-loaded (backbone, adapter, warm-up), idle,
                                 receiving its first request
    warm_ttft_s                  the same instance's next request

The backbone daemon runs throughout: the backbone is already resident on the device (shared by other functions),
which is the situation lorafaas is built for. lorafaas times are measured by a client over the worker's socket, from
process start (or request) to the first token event.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from lorafaas.errors import InstanceUnavailable
from lorafaas.function_runtime import messages as m
from lorafaas.function_runtime.zygote import prepare_backbone
from lorafaas.platform.backends.local import InstanceHandle, LocalLauncher
from lorafaas.progress import ProgressSink, SilentProgress

PROMPT = "Tell me about the ocean."
SAMPLE_TIMEOUT_S = 600.0


class ColdStartResult(msgspec.Struct, frozen=True, kw_only=True):
    backbone: str
    adapter: str
    repeats: int
    standalone_ttft_s: float
    cold_ttft_s: float
    libraries_preloaded_ttft_s: float
    all_preloaded_ttft_s: float
    warm_ttft_s: float
    adapter_load_s: float
    breakdown: dict[str, dict[str, float]]  # case -> step -> median seconds
    ratio_standalone_over_libraries_preloaded: float
    ratio_all_preloaded_over_warm: float


def run_coldstart_bench(
    home: Path, backbone: str, adapter_dir: Path, repeats: int = 3, progress: ProgressSink | None = None
) -> ColdStartResult:
    progress = progress or SilentProgress()
    if repeats < 1:
        raise ValueError(f"repeats is {repeats}; it must be at least 1")
    samples: dict[str, list[dict[str, float]]] = {case: [] for case in ("standalone", "cold", "libraries_preloaded",
                                                                        "all_preloaded", "warm")}
    with LocalLauncher(home) as launcher:
        progress.stage(f"starting the {backbone} daemon and the library pool")
        model_dir = launcher.store.path(backbone)
        launcher.daemon_socket(backbone)
        launcher.start_zygote()
        prepare_backbone(launcher.zygote_socket, model_dir)
        progress.stage("sampling cold starts", repeats * 4)
        for _ in range(repeats):
            samples["standalone"].append(_standalone(model_dir, adapter_dir))
            progress.advance()
            samples["cold"].append(_instance_start(launcher, backbone, adapter_dir, fresh=True))
            progress.advance()
            samples["libraries_preloaded"].append(_instance_start(launcher, backbone, adapter_dir, fresh=False))
            progress.advance()
            preloaded, warm = _preloaded_and_warm(launcher, backbone, adapter_dir)
            samples["all_preloaded"].append(preloaded)
            samples["warm"].append(warm)
            progress.advance()
    breakdown = {case: _medians(rows) for case, rows in samples.items()}
    ttft = {case: steps["ttft"] for case, steps in breakdown.items()}
    return ColdStartResult(
        backbone=backbone,
        adapter=Path(adapter_dir).name,
        repeats=repeats,
        standalone_ttft_s=ttft["standalone"],
        cold_ttft_s=ttft["cold"],
        libraries_preloaded_ttft_s=ttft["libraries_preloaded"],
        all_preloaded_ttft_s=ttft["all_preloaded"],
        warm_ttft_s=ttft["warm"],
        adapter_load_s=breakdown["all_preloaded"]["adapter"],
        breakdown=breakdown,
        ratio_standalone_over_libraries_preloaded=ttft["standalone"] / ttft["libraries_preloaded"],
        ratio_all_preloaded_over_warm=ttft["all_preloaded"] / ttft["warm"],
    )


def _standalone(model_dir: Path, adapter_dir: Path) -> dict[str, float]:
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "lorafaas.bench.standalone", str(model_dir), str(adapter_dir), PROMPT,
         "--threads", "1"],  # as lorafaas workers: one intra-op thread each
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    assert process.stdout is not None  # (a pipe: asked for above)
    line = process.stdout.readline()
    ttft = time.perf_counter() - started
    process.wait(SAMPLE_TIMEOUT_S)
    if not line:
        raise InstanceUnavailable(f"the standalone baseline exited with code {process.returncode} before a token")
    report = json.loads(line)
    interpreter = ttft - report["total_s"]
    return {"ttft": ttft, "process_start": interpreter, **report["timings"]}


def _instance_start(launcher: LocalLauncher, backbone: str, adapter_dir: Path, fresh: bool) -> dict[str, float]:
    spec = launcher.spec("bench", backbone, adapter_dir)
    started = time.perf_counter()
    instance = launcher.launch(spec, fresh=fresh, timeout_s=SAMPLE_TIMEOUT_S)
    listening = time.perf_counter() - started

    async def first_token() -> tuple[float, m.Stats]:
        async with await instance.connect() as worker:
            async for event in worker.generate(_request("first")):
                if isinstance(event, m.Token):
                    break
            ttft = time.perf_counter() - started
            return ttft, await worker.stats()

    try:
        ttft, stats = asyncio.run(first_token())
    finally:
        _stop(launcher, instance)
    steps = dict(stats.stage_seconds)
    return {"ttft": ttft, "process_start": listening, **steps,
            "first_token": ttft - listening - sum(steps.values())}


def _preloaded_and_warm(launcher: LocalLauncher, backbone: str, adapter_dir: Path):
    instance = launcher.launch(launcher.spec("bench", backbone, adapter_dir))

    async def measure() -> tuple[dict[str, float], dict[str, float]]:
        async with await instance.connect() as worker:
            staged: dict[str, float] = {stage: (await worker.stage(stage)).seconds for stage in m.STAGES}
            results = []
            for name in ("preloaded", "warm"):
                started = time.perf_counter()
                async for event in worker.generate(_request(name)):
                    if isinstance(event, m.Token):
                        results.append(time.perf_counter() - started)
                        break
            return {"ttft": results[0], **staged}, {"ttft": results[1]}

    try:
        return asyncio.run(measure())
    finally:
        _stop(launcher, instance)


def _request(request_id: str) -> m.Generate:
    return m.Generate(request_id=request_id, messages=(m.ChatMessage("user", PROMPT),),
                      params=m.SamplingParams(max_tokens=1))


def _stop(launcher: LocalLauncher, instance: InstanceHandle) -> None:
    instance.kill()
    launcher.instances.remove(instance)


def _medians(rows: list[dict[str, float]]) -> dict[str, float]:
    return {key: round(statistics.median(row[key] for row in rows), 4) for key in rows[0]}
