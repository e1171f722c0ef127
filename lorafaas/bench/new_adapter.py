"""`lorafaas bench new-adapter`: how long a new adapter takes to its first token, on lorafaas and on vLLM, one run.

A sample makes a new adapter callable under a name never used before, then streams its first completion:

    lorafaas   POST /v1/functions (the adapter's archive and {"name", "backbone"}): a new function, then its first
               request, which starts its instance (nothing of a function deployed a moment ago is pre-loaded)
    vllm       POST /v1/load_lora_adapter ({"lora_name", "lora_path"}; the server needs
               VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), then its first request

Per sample: `register_s` (the registration's reply), `ttft_s` (the first request's first token, timed as `bench
serve` times it) and `total_s`, their sum; on lorafaas also `stages`, its instance's start stage by stage as
`describe` shows it (prepare, spawn, standby_warm, libraries, backbone, adapter, total, first_prefill, first_token).
The targets alternate sample by sample, each after a pause (`settle_s`)
in which the other server goes idle, and each sample's adapter is removed afterwards (DELETE /v1/functions/NAME;
POST /v1/unload_lora_adapter), so every sample is a first load.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from pathlib import Path
from typing import Literal

import httpx
import msgspec

from lorafaas.bench.serve import ServeBenchConfig, Target, make_prompts, one_request, shown_key
from lorafaas.platform.adapter_upload import pack_adapter
from lorafaas.progress import ProgressSink, SilentProgress

ServerKind = Literal["lorafaas", "vllm"]


class NewAdapterTarget(msgspec.Struct, frozen=True, kw_only=True):
    kind: ServerKind
    url: str  # base URL, without /v1


class NewAdapterConfig(msgspec.Struct, frozen=True, kw_only=True):
    adapter_dir: str  # a PEFT adapter directory, readable by this process and (for vLLM) by the server
    backbone: str = "smollm2-135m"  # lorafaas: the function's backbone
    repeats: int = 5
    output_len: int = 16
    prompt_len: int = 32
    api_key: str | None = None
    timeout_s: float = 300.0
    # a pause before each sample: vLLM's CPU engine keeps its threads spinning for a while after a request, and a
    # lorafaas sample started right after a vLLM one shared the cores with them (1.07 s against 0.32-0.42 s)
    settle_s: float = 3.0


class NewAdapterSample(msgspec.Struct, frozen=True, kw_only=True):
    kind: ServerKind
    name: str
    register_s: float
    ttft_s: float
    total_s: float
    # lorafaas: its instance's start, stage by stage (describe's `cold_start`: spawn, adapter, first_token, ...)
    stages: dict[str, float] = {}


class NewAdapterSummary(msgspec.Struct, frozen=True, kw_only=True):
    kind: ServerKind
    median_register_s: float
    median_ttft_s: float
    median_total_s: float
    median_stages: dict[str, float] = {}  # lorafaas: per stage, over the samples that had it


class NewAdapterResult(msgspec.Struct, frozen=True, kw_only=True):
    config: NewAdapterConfig
    targets: tuple[NewAdapterTarget, ...]
    samples: tuple[NewAdapterSample, ...]
    summaries: tuple[NewAdapterSummary, ...]


def run_new_adapter_bench(targets: list[NewAdapterTarget], config: NewAdapterConfig,
                          progress: ProgressSink | None = None) -> NewAdapterResult:
    if not (Path(config.adapter_dir) / "adapter_config.json").is_file():
        raise ValueError(f"--adapter {config.adapter_dir}: no adapter_config.json there (a PEFT adapter directory)")
    return asyncio.run(_run(targets, config, progress or SilentProgress()))


async def _run(targets: list[NewAdapterTarget], config: NewAdapterConfig, progress: ProgressSink
               ) -> NewAdapterResult:
    archive = pack_adapter(Path(config.adapter_dir))
    prompt = make_prompts(1, config.prompt_len, seed=0)[0]
    samples: list[NewAdapterSample] = []
    progress.stage("new adapters", total=config.repeats * len(targets))
    async with httpx.AsyncClient(timeout=config.timeout_s) as http:
        for k in range(config.repeats):
            order = targets if k % 2 == 0 else list(reversed(targets))  # A B, B A, ...: a drift falls on both
            for target in order:
                await asyncio.sleep(config.settle_s)
                samples.append(await _sample(http, target, config, archive, prompt))
                progress.advance()
    summaries = tuple(
        NewAdapterSummary(kind=t.kind, median_register_s=statistics.median(s.register_s for s in mine),
                          median_ttft_s=statistics.median(s.ttft_s for s in mine),
                          median_total_s=statistics.median(s.total_s for s in mine),
                          median_stages=_median_stages([s.stages for s in mine]))
        for t in targets if (mine := [s for s in samples if s.kind == t.kind]))
    shown = msgspec.structs.replace(config, api_key=shown_key(config.api_key))
    return NewAdapterResult(config=shown, targets=tuple(targets), samples=tuple(samples), summaries=summaries)


def _median_stages(samples: list[dict[str, float]]) -> dict[str, float]:
    names = dict.fromkeys(stage for stages in samples for stage in stages)  # in the order the first start had them
    return {name: statistics.median(s[name] for s in samples if name in s) for name in names}


async def _sample(http: httpx.AsyncClient, target: NewAdapterTarget, config: NewAdapterConfig, archive: bytes,
                  prompt: str) -> NewAdapterSample:
    name = f"new-{uuid.uuid4().hex[:10]}"
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    started = time.perf_counter()
    if target.kind == "lorafaas":
        spec = json.dumps({"name": name, "backbone": config.backbone})
        reply = await http.post(f"{target.url}/v1/functions", headers=headers, data={"spec": spec},
                                files={"adapter": ("adapter.tar.gz", archive, "application/gzip")})
    else:
        reply = await http.post(f"{target.url}/v1/load_lora_adapter", headers=headers,
                                json={"lora_name": name, "lora_path": str(Path(config.adapter_dir).resolve())})
    register_s = time.perf_counter() - started
    if reply.status_code not in (200, 201):
        raise RuntimeError(f"{target.kind} at {target.url}: registering adapter {name} answered HTTP "
                           f"{reply.status_code}: {reply.text[:300]}")
    try:
        request = ServeBenchConfig(models=(name,), concurrencies=(1,), requests=1, output_len=config.output_len,
                                   api_key=config.api_key, timeout_s=config.timeout_s)
        outcome = await one_request(http, Target(label=target.kind, url=target.url), name, prompt, request)
        if not outcome.ok:
            raise RuntimeError(f"{target.kind} at {target.url}: the first request to {name} failed: {outcome.error}")
        stages = await _start_stages(http, target, name, headers) if target.kind == "lorafaas" else {}
    finally:
        if target.kind == "lorafaas":
            await http.delete(f"{target.url}/v1/functions/{name}", headers=headers)
        else:
            await http.post(f"{target.url}/v1/unload_lora_adapter", headers=headers, json={"lora_name": name})
    return NewAdapterSample(kind=target.kind, name=name, register_s=register_s, ttft_s=outcome.ttft_s,
                            total_s=register_s + outcome.ttft_s, stages=stages)


async def _start_stages(http: httpx.AsyncClient, target: NewAdapterTarget, name: str, headers: dict[str, str]
                        ) -> dict[str, float]:
    """The breakdown of the start that served the function's first request (`describe`); {} if it has none."""
    reply = await http.get(f"{target.url}/v1/functions/{name}", headers=headers)
    if reply.status_code != 200:
        return {}
    described = reply.json()
    starts = [i["cold_start"] for i in described.get("instances", []) if i.get("cold_start")]
    return dict(starts[0]) if starts else dict(described.get("last_cold_start") or {})
