"""The GPU check's platform step: `lorafaas up --devices cuda:0` as a user runs it, measured from outside.

One platform process serves every phase, in this order (each phase's figures under its own key):

    zero_copy    device memory before any function, with 1 and with 8 functions of the medium shape warm: the growth
                 per function against one backbone (NVML: the device's total and each process's own)
    speed        `bench serve` at 1, 8 and 32 concurrent over 3 of those functions, against transformers + PEFT
                 serving the same adapters in one process on the same device (lorafaas.bench.peft_server)
    new_function a function deployed a moment ago: deploy reply and its first request's first token
    exactness    greedy token ids through `/v1/completions` equal PEFT's on the same device, float32 and bf16, alone and
                 8 in flight (the shared base pass is CPU-only: no GPU mode to check)
    faults       the medium shape's daemon killed while its functions serve: what clients see, how long until requests
                 succeed again, and whether the device then holds a second copy of the backbone
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import psutil

from lorafaas.bench.gpu_context import CheckContext, StepResult
from lorafaas.bench.gpu_models import backbone_name
from lorafaas.bench.serve import ServeBenchConfig, Target, run_serve_bench
from lorafaas.formats.model_store import ModelStore
from lorafaas.testing.child_process import stop_child
from lorafaas.testing.platform_process import PlatformProcess, free_port, processes_naming

MAX_NEW_TOKENS = 16
PROMPTS = ((1, 5, 7, 9, 100, 200, 300, 42), (17, 256, 511, 3, 64, 65, 66, 67, 68, 69, 70, 71),
           (400, 401, 402, 403), (9, 8, 7, 6, 5, 4, 3, 2, 1, 300, 301, 302, 303, 304, 305, 306))
SPEED_LEVELS = (1, 8, 32)
SPEED_OUTPUT_TOKENS = 32  # per request, with ignore_eos; requests per level: twice the concurrency, at least 8
SPEED_GOAL = 1.5  # lorafaas over transformers + PEFT at 8 and 32 concurrent
MEMORY_GOAL = 1.2  # device memory of 8 functions over one backbone plus their adapters and KV


class DeviceMemory:
    """Device memory in use: NVML on a GPU; on the CPU (dry run) the host's PSS of the platform's processes."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._nvml = None
        if device.startswith("cuda"):
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(int(device.partition(":")[2]))

    def used(self, pids: set[int]) -> int:
        if self._nvml is not None:
            return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)
        return sum(self.per_process(pids).values())

    def per_process(self, pids: set[int]) -> dict[int, int]:
        if self._nvml is not None:
            try:
                found = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
            except self._nvml.NVMLError:
                return {}
            return {p.pid: int(p.usedGpuMemory or 0) for p in found}
        sizes = {}
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                sizes[pid] = psutil.Process(pid).memory_full_info().pss
        return sizes


def _completion(url: str, key: str, model: str, prompt: tuple[int, ...]) -> list[int]:
    body = {"model": model, "prompt": list(prompt), "max_tokens": MAX_NEW_TOKENS, "temperature": 0.0, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    reply = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=300)
    reply.raise_for_status()
    tokens = reply.json()["choices"][0]["logprobs"]["tokens"]
    return [int(t.removeprefix("token_id:")) for t in tokens]


async def _completions_in_flight(url: str, key: str, jobs: Sequence[tuple[str, tuple[int, ...]]], in_flight: int):
    limit = asyncio.Semaphore(in_flight)

    async def one(model: str, prompt: tuple[int, ...]) -> list[int]:
        async with limit:
            return await asyncio.to_thread(_completion, url, key, model, prompt)

    return await asyncio.gather(*(one(m, p) for m, p in jobs))


def _peft_references(ctx: CheckContext, backbone: str, dtype: str, adapters: list[Path]) -> list[list[list[int]]]:
    """PEFT's greedy token ids on the same device: [adapter][prompt] -> ids (stopping at EOS, as the platform)."""
    import torch

    from lorafaas.models.reference import load_backbone, with_adapter

    model, tokenizer = load_backbone(ctx.store.path(backbone), dtype)
    model = model.to(ctx.device)
    results = []
    for adapter in adapters:
        peft_model = with_adapter(model, adapter)
        rows = []
        for prompt in PROMPTS:
            ids = torch.tensor([prompt], device=ctx.device)
            with torch.inference_mode():
                out = peft_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                          max_new_tokens=MAX_NEW_TOKENS, eos_token_id=tokenizer.eos_token_id,
                                          pad_token_id=tokenizer.pad_token_id)
            rows.append(out[0, len(prompt):].tolist())
        results.append(rows)
        model = peft_model.unload()  # the bare backbone again, for the next adapter
    del model
    if ctx.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return results


def _trim_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def _exactness(ctx: CheckContext, platform: PlatformProcess, client) -> dict:
    figures: dict[str, Any] = {}
    for dtype in ("float32", "bfloat16"):
        backbone = backbone_name(ctx.small, dtype)
        adapters = ctx.adapters[backbone]
        names = [f"exact-{dtype[:4]}-{i}" for i in range(len(adapters))]
        for name, adapter in zip(names, adapters, strict=True):
            client.deploy({"name": name, "backbone": backbone}, adapter)
        references = _peft_references(ctx, backbone, dtype, adapters)
        eos = _eos_id(ctx, backbone)
        jobs = [(name, prompt) for name in names for prompt in PROMPTS]
        expected = [_trim_eos(references[i][j], eos) for i in range(len(names)) for j in range(len(PROMPTS))]
        alone = [_trim_eos(_completion(platform.url, platform.admin_key, m, p), eos) for m, p in jobs]
        together = asyncio.run(_completions_in_flight(platform.url, platform.admin_key, jobs, 8))
        together = [_trim_eos(t, eos) for t in together]
        figures[dtype] = {
            "alone": f"{sum(a == e for a, e in zip(alone, expected, strict=True))}/{len(jobs)}",
            "in_flight_8": f"{sum(t == e for t, e in zip(together, expected, strict=True))}/{len(jobs)}",
            "first_mismatch": next(({"function": j[0], "prompt": list(j[1]), "lorafaas": a, "peft": e}
                                    for j, a, e in zip(jobs, alone, expected, strict=True) if a != e), None),
            "shared_base_pass": "not on GPUs: the pass's executor is CPU-only",
        }
        ctx.log(f"exactness {dtype}: {figures[dtype]['alone']} alone, {figures[dtype]['in_flight_8']} in flight")
    return figures


def _eos_id(ctx: CheckContext, backbone: str) -> int:
    import json

    return int(json.loads((ctx.store.path(backbone) / "config.json").read_text())["eos_token_id"])


def _warm(platform: PlatformProcess, name: str) -> None:
    _completion(platform.url, platform.admin_key, name, PROMPTS[0])


def _zero_copy(ctx: CheckContext, platform: PlatformProcess, client, memory: DeviceMemory, names: list[str],
               idle_context: int) -> dict:
    backbone = backbone_name(ctx.medium, "bfloat16")
    pids = set(processes_naming(platform.home))
    before = memory.used(pids)
    for name, adapter in zip(names, ctx.adapters[backbone], strict=False):
        client.deploy({"name": name, "backbone": backbone}, adapter)
    _warm(platform, names[0])
    pids = set(processes_naming(platform.home))
    one = memory.used(pids)
    for name in names[1:]:
        _warm(platform, name)
    pids = set(processes_naming(platform.home))
    eight = memory.used(pids)
    per_process = memory.per_process(pids)
    backbone_bytes = ctx.store.get(backbone).bytes
    adapter_bytes = sum(sum(f.stat().st_size for f in a.iterdir()) for a in ctx.adapters[backbone][: len(names)])
    per_function = (eight - one) / (len(names) - 1)
    figures: dict[str, Any] = {
        "backbone_bytes": backbone_bytes, "adapters_bytes": adapter_bytes, "before": before, "one_function": one,
        "eight_functions": eight, "growth_per_function": int(per_function), "idle_cuda_context": idle_context,
        "per_process": {str(pid): size for pid, size in sorted(per_process.items())},
        "largest_process": max(per_process.values(), default=0),
    }
    # What the check claims: no function holds a copy; the device holds one backbone plus, per function, its adapter,
    # KV cache and workspace. Each process that uses the device (8 functions and the daemon) also holds a CUDA context,
    # the same as a bare torch process's: counted apart.
    contexts = (len(names) + 1) * idle_context
    functions = [size for pid, size in per_process.items() if pid in pids and size < backbone_bytes]
    figures["function_process_mean"] = int(sum(functions) / len(functions)) if functions else 0
    figures["function_own_mean"] = figures["function_process_mean"] - idle_context
    figures["ratio_over_backbone_adapters"] = round((eight - before - contexts) / (backbone_bytes + adapter_bytes), 3)
    figures["ratio_with_contexts"] = round((eight - before) / (backbone_bytes + adapter_bytes), 3)
    return figures


def _idle_context_bytes(ctx: CheckContext, memory: DeviceMemory) -> int:
    """A bare torch process's own device memory once it ran one product: the CUDA context and torch's workspace."""
    if not ctx.device.startswith("cuda"):
        return 0
    code = ("import torch, sys; x = torch.ones(64, 64, device=sys.argv[1]); (x @ x).sum().item(); "
            "print('ready', flush=True); sys.stdin.readline()")
    process = subprocess.Popen([sys.executable, "-c", code, ctx.device], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    try:
        assert process.stdout is not None  # (a pipe: asked for above)
        process.stdout.readline()
        time.sleep(0.5)
        return memory.per_process({process.pid}).get(process.pid, 0)
    finally:
        process.communicate("\n", timeout=30)


def _speed(ctx: CheckContext, platform: PlatformProcess, names: list[str]) -> dict:
    backbone = backbone_name(ctx.medium, "bfloat16")
    adapters = ctx.adapters[backbone][: len(names)]
    port = free_port()
    command = [sys.executable, "-m", "lorafaas.bench.peft_server", "--model", str(ctx.store.path(backbone)),
               "--device", ctx.device, "--dtype", "bfloat16", "--port", str(port), "--max-batch", "32",
               *(arg for name, a in zip(names, adapters, strict=True) for arg in ("--adapter", f"{name}={a}"))]
    with (ctx.work / "peft-server.log").open("ab") as log:
        server = subprocess.Popen(command, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}/health", server, 600)
        targets = [Target(label="lorafaas", url=platform.url, server_pid=platform.pid),
                   Target(label="peft", url=f"http://127.0.0.1:{port}", server_pid=server.pid)]
        levels: list[Any] = []
        for n, concurrency in enumerate(SPEED_LEVELS if not ctx.dry_run else (1, 4)):
            config = ServeBenchConfig(models=tuple(names), concurrencies=(concurrency,),
                                      requests=2 * concurrency if ctx.dry_run else max(8, 2 * concurrency),
                                      output_len=8 if ctx.dry_run else SPEED_OUTPUT_TOKENS, prompt_len=32,
                                      ignore_eos=True, api_key=platform.admin_key, warmup=n == 0)
            levels += run_serve_bench(targets, config).levels
    finally:
        stop_child(server, 30)
    figures: dict = {}
    for level in levels:
        figures.setdefault(str(level.concurrency), {})[level.target] = {
            "tokens_per_s": round(level.output_tokens_per_s, 1), "failed": level.failed,
            "ttft_p50_ms": round(level.ttft.p50_ms, 1), "e2e_p50_ms": round(level.e2e_latency.p50_ms, 1),
            "errors": list(level.errors)}
    for fig in figures.values():
        if fig.get("peft", {}).get("tokens_per_s"):
            fig["ratio"] = round(fig["lorafaas"]["tokens_per_s"] / fig["peft"]["tokens_per_s"], 2)
    return figures


def _wait_healthy(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} was not healthy within {timeout_s} s")


def _new_function(ctx: CheckContext, platform: PlatformProcess, client) -> dict:
    backbone = backbone_name(ctx.medium, "bfloat16")
    adapter = ctx.adapters[backbone][-1]
    started = time.perf_counter()
    client.deploy({"name": "brand-new", "backbone": backbone}, adapter)
    deployed = time.perf_counter()
    body = {"model": "brand-new", "prompt": list(PROMPTS[0]), "max_tokens": 4, "temperature": 0.0, "stream": True}
    first = None
    with httpx.stream("POST", f"{platform.url}/v1/completions", json=body, timeout=300,
                      headers={"Authorization": f"Bearer {platform.admin_key}"}) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith("data:") and '"text"' in line and first is None:
                first = time.perf_counter()
    if first is None:
        raise RuntimeError("the new function's stream carried no token")
    return {"deploy_s": round(deployed - started, 3), "first_token_s": round(first - deployed, 3),
            "total_s": round(first - started, 3)}


def _attach(ctx: CheckContext, platform: PlatformProcess) -> dict:
    """A fresh process's attach to the platform's own daemon of the medium shape, its CUDA context made first."""
    from lorafaas.bench.daemon import sample_process
    from lorafaas.protocols.daemon_config import DaemonConfig

    backbone = backbone_name(ctx.medium, "bfloat16")
    socket = DaemonConfig(home=platform.home, backbone=backbone, device=ctx.device).paths.socket
    sample = sample_process(["attach", str(socket), str(ctx.store.path(backbone)), ctx.device])
    return {"backbone": backbone, "context_ms": round(sample.context_s * 1e3, 1),
            "map_ms": round(sample.map_s * 1e3, 2), "bind_ms": round(sample.bind_s * 1e3, 2),
            "attach_ms": round(sample.load_s * 1e3, 2)}


def _faults(ctx: CheckContext, platform: PlatformProcess, memory: DeviceMemory, names: list[str]) -> dict:
    backbone = backbone_name(ctx.medium, "bfloat16")
    daemons = [pid for pid, cmd in processes_naming(platform.home).items()
               if "backbone_daemon" in cmd and backbone in cmd]
    if not daemons:
        raise RuntimeError(f"no daemon process of {backbone} found")
    before = memory.used(set(processes_naming(platform.home)))
    outcomes: list[tuple[float, bool, str]] = []
    killed_at = time.perf_counter()
    os.kill(daemons[0], signal.SIGKILL)
    recovered_s = None
    deadline = killed_at + 120
    while time.perf_counter() < deadline:
        for name in names:
            try:
                _completion(platform.url, platform.admin_key, name, PROMPTS[1])
                outcomes.append((time.perf_counter() - killed_at, True, ""))
            except httpx.HTTPError as exc:
                text = exc.response.text[:200] if isinstance(exc, httpx.HTTPStatusError) else str(exc)[:200]
                outcomes.append((time.perf_counter() - killed_at, False, text))
        if outcomes and all(ok for _, ok, _ in outcomes[-len(names):]):
            recovered_s = outcomes[-len(names)][0]
            break
        time.sleep(0.5)
    after = memory.used(set(processes_naming(platform.home)))
    backbone_bytes = ctx.store.get(backbone).bytes
    new_daemons = [pid for pid, cmd in processes_naming(platform.home).items()
                   if "backbone_daemon" in cmd and backbone in cmd]
    return {"requests": len(outcomes), "failed": sum(not ok for _, ok, _ in outcomes),
            "errors": sorted({e for _, ok, e in outcomes if not ok})[:5], "recovered_s": recovered_s,
            "daemon_restarted": bool(new_daemons) and new_daemons != daemons,
            "memory_growth_bytes": after - before, "backbone_bytes": backbone_bytes,
            "copies_after": round(1 + (after - before) / backbone_bytes, 2)}


def run_platform_checks(ctx: CheckContext) -> StepResult:
    memory = DeviceMemory(ctx.device)
    idle_context = _idle_context_bytes(ctx, memory)
    home = ctx.work / "platform-home"
    shutil.rmtree(home, ignore_errors=True)  # a fresh platform: no function, daemon or record of an earlier run
    store = ModelStore(home / "models")
    for shape, dtype in ((ctx.small, "float32"), (ctx.small, "bfloat16"), (ctx.medium, "bfloat16")):
        name = backbone_name(shape, dtype)
        store.import_dir(name, ctx.store.path(name))
    budget = "cpu" if ctx.device == "cpu" else f"{ctx.device}=60G"
    figures: dict = {}
    failures: list[str] = []
    names = [f"fn-{i}" for i in range(8)]
    with PlatformProcess(home, extra_args=("--devices", budget)) as platform, platform.client() as client:
        for phase, run in (
            ("zero_copy", lambda: _zero_copy(ctx, platform, client, memory, names, idle_context)),
            ("speed", lambda: _speed(ctx, platform, names[:3])),
            ("new_function", lambda: _new_function(ctx, platform, client)),
            ("exactness", lambda: _exactness(ctx, platform, client)),
            ("attach", lambda: _attach(ctx, platform)),
            ("faults", lambda: _faults(ctx, platform, memory, names[:3])),
        ):
            ctx.log(f"platform: {phase}")
            try:
                figures[phase] = run()
            except Exception as exc:  # each phase reports on its own
                figures[phase] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                failures.append(phase)
                print(traceback.format_exc()[-3000:], file=sys.stderr, flush=True)
            ctx.log(f"platform: {phase}: {figures[phase]}")
        figures["log_tail"] = platform.log()[-3000:]
    verdicts = _verdicts(ctx, figures)
    failures += [v for v, ok in verdicts.items() if not ok]
    return StepResult(name="platform", ok=not failures, figures={**figures, "verdicts": verdicts},
                      summary="; ".join(f"{v}: {'ok' if ok else 'FAIL'}" for v, ok in verdicts.items()))


def _verdicts(ctx: CheckContext, figures: dict) -> dict[str, bool]:
    def all_match(text: str) -> bool:
        done, _, total = text.partition("/")
        return done == total

    exact = figures.get("exactness", {})
    verdicts = {"exact": all(all_match(exact.get(d, {}).get(m, "0/1")) for d in ("float32", "bfloat16")
                             for m in ("alone", "in_flight_8"))}
    zero = figures.get("zero_copy", {})
    verdicts["zero_copy"] = "error" not in zero and (ctx.dry_run or zero.get("ratio_over_backbone_adapters", 9)
                                                     <= MEMORY_GOAL)
    speed = figures.get("speed", {})
    verdicts["speed"] = "error" not in speed and (ctx.dry_run or all(
        speed.get(str(c), {}).get("ratio", 0) >= SPEED_GOAL for c in (8, 32)))
    verdicts["new_function"] = "error" not in figures.get("new_function", {"error": 1})
    verdicts["attach"] = "error" not in figures.get("attach", {"error": 1})
    faults = figures.get("faults", {})
    verdicts["faults"] = "error" not in faults and faults.get("recovered_s") is not None and (
        ctx.dry_run or faults.get("copies_after", 9) < 1.5)
    return verdicts
