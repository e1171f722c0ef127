"""`lorafaas bench memory`: memory of N functions with distinct adapters, lorafaas vs one process each, same run.

    lorafaas_total_pss_mb     PSS summed over the backbone daemon, the library pool and N workers, each worker
                              staged (backbone, adapter, warm-up) and having served one request
    standalone_total_pss_mb   PSS summed over N conventional processes (from_pretrained + PEFT adapter), each
                              having computed its first token, each reading its own copy of the backbone files as a
                              function in its own container does
    standalone_same_files_total_pss_mb
                              the same N processes all reading the store's one copy: from_pretrained memory-maps
                              safetensors, so the page cache shares the weights between them (reported so the
                              comparison is complete; separate containers do not share a file)
    marginal_pss_mb           what the Nth lorafaas instance added to the total (total at N minus total at N-1)
    pss_mb_by_kind            the total at N by process kind: backbone daemon, library pool (the zygote), workers
    worker_own_mb             per worker at N, its own memory: its PSS less its share of the backbone segment (what
                              one more function costs the machine), largest and mean
    worker_own_parts_mb       the largest worker's own memory by mapping: heap (anonymous memory: Python objects,
                              tensors, KV cache, malloc's arenas), libraries (.so and interpreter), other files, and
                              beside them its segment share

PSS divides every shared page among the processes that map it, so a sum of PSS counts the shared backbone once.
The adapters are the demo adapters plus random ones of the same shapes, so that all N differ.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec

from lorafaas.config import LorafaasConfig
from lorafaas.errors import InstanceUnavailable
from lorafaas.formats.model_store import ModelStore
from lorafaas.function_runtime import messages as m
from lorafaas.function_runtime.memory import MemoryParts, read_memory, read_memory_parts
from lorafaas.function_runtime.zygote import prepare_backbone
from lorafaas.platform.backends.local import LocalLauncher
from lorafaas.progress import ProgressSink, SilentProgress
from lorafaas.testing.synthetic_adapters import write_random_adapter

PROMPT = "Tell me about the ocean."
MB = 1024 * 1024


class MemoryResult(msgspec.Struct, frozen=True, kw_only=True):
    backbone: str
    num_functions: int
    backbone_mb: float
    lorafaas_total_pss_mb: float
    standalone_total_pss_mb: float
    standalone_same_files_total_pss_mb: float
    marginal_pss_mb: float
    ratio_standalone_over_lorafaas: float
    lorafaas_total_pss_mb_by_count: list[float]  # total after 1, 2, ... N instances
    pss_mb_by_kind: dict[str, float]
    worker_own_mb: dict[str, float]  # max, mean
    worker_own_parts_mb: dict[str, float]


def bench_adapters(home: Path, backbone: str, demo_dirs: list[Path], count: int) -> list[Path]:
    """`count` distinct adapters: the demo ones first, then random ones of the backbone's shapes."""
    store = ModelStore(LorafaasConfig(home=Path(home)).models_dir)
    adapters = list(demo_dirs[:count])
    for seed in range(count - len(adapters)):
        out = Path(home) / "bench" / "adapters" / f"random-{seed}"
        if not (out / "adapter_model.safetensors").is_file():
            write_random_adapter(out, store, backbone, seed=seed)
        adapters.append(out)
    return adapters


def run_memory_bench(
    home: Path, backbone: str, adapters: list[Path], progress: ProgressSink | None = None
) -> MemoryResult:
    progress = progress or SilentProgress()
    if len(adapters) < 2:
        raise ValueError("the memory bench needs at least two adapters (the marginal is the last one's cost)")
    store = ModelStore(LorafaasConfig(home=Path(home)).models_dir)
    manifest = store.get(backbone)
    totals, parts = _lorafaas_totals(home, backbone, adapters, progress)
    copies_dir = Path(home) / "bench" / "standalone-copies"
    try:
        progress.stage(f"copying the backbone files for {len(adapters)} standalone processes")
        copies = [Path(shutil.copytree(store.path(backbone), copies_dir / str(i))) for i in range(len(adapters))]
        standalone = _standalone_total(copies, adapters, progress)
    finally:
        shutil.rmtree(copies_dir, ignore_errors=True)
    same_files = _standalone_total([store.path(backbone)] * len(adapters), adapters, progress)
    return MemoryResult(
        backbone=backbone,
        num_functions=len(adapters),
        backbone_mb=round(manifest.bytes / MB, 1),
        lorafaas_total_pss_mb=round(totals[-1] / MB, 1),
        standalone_total_pss_mb=round(standalone / MB, 1),
        standalone_same_files_total_pss_mb=round(same_files / MB, 1),
        marginal_pss_mb=round((totals[-1] - totals[-2]) / MB, 1),
        ratio_standalone_over_lorafaas=round(standalone / totals[-1], 2),
        lorafaas_total_pss_mb_by_count=[round(t / MB, 1) for t in totals],
        pss_mb_by_kind={kind: round(sum(p.pss_bytes for p in ps) / MB, 1) for kind, ps in parts.items()},
        worker_own_mb=_worker_own(parts["workers"]),
        worker_own_parts_mb=_own_parts(max(parts["workers"], key=lambda p: p.own_bytes)),
    )


def _worker_own(workers: list[MemoryParts]) -> dict[str, float]:
    return {"max": round(max(p.own_bytes for p in workers) / MB, 1),
            "mean": round(sum(p.own_bytes for p in workers) / len(workers) / MB, 1)}


def _own_parts(worker: MemoryParts) -> dict[str, float]:
    return {"heap": round(worker.heap_bytes / MB, 1), "libraries": round(worker.libraries_bytes / MB, 1),
            "other": round(worker.other_bytes / MB, 1), "segment_share": round(worker.segment_bytes / MB, 1)}


def _lorafaas_totals(home: Path, backbone: str, adapters: list[Path], progress: ProgressSink
                     ) -> tuple[list[int], dict[str, list[MemoryParts]]]:
    """The PSS total after each instance, and each process's parts at the end by kind."""
    totals = []
    with LocalLauncher(home) as launcher:
        progress.stage(f"starting the {backbone} daemon and the library pool")
        daemon_pid = _daemon_pid(launcher, backbone)
        launcher.start_zygote()
        prepare_backbone(launcher.zygote_socket, launcher.store.path(backbone))
        zygote_pid = launcher.zygote_pid
        progress.stage(f"starting {len(adapters)} lorafaas instances", len(adapters))
        for index, adapter in enumerate(adapters):
            instance = launcher.launch(launcher.spec(f"fn-{index}", backbone, adapter))
            asyncio.run(_stage_and_serve(instance))
            pids = [daemon_pid, zygote_pid, *(i.pid for i in launcher.instances)]
            totals.append(sum(read_memory(pid).pss_bytes for pid in pids))
            progress.advance()
        parts = {"backbone daemon": [read_memory_parts(daemon_pid)], "library pool": [read_memory_parts(zygote_pid)],
                 "workers": [read_memory_parts(i.pid) for i in launcher.instances]}
    return totals, parts


def _daemon_pid(launcher: LocalLauncher, backbone: str) -> int:
    from lorafaas.protocols.daemon_client import DaemonClient

    with DaemonClient.connect(launcher.daemon_socket(backbone)) as daemon:
        return daemon.status().daemon_pid


async def _stage_and_serve(instance) -> None:
    async with await instance.connect() as worker:
        for stage in m.STAGES:
            await worker.stage(stage)
        request = m.Generate(request_id="probe", messages=(m.ChatMessage("user", PROMPT),),
                             params=m.SamplingParams(max_tokens=8))
        async for _ in worker.generate(request):
            pass


def _standalone_total(model_dirs: list[Path], adapters: list[Path], progress: ProgressSink) -> int:
    progress.stage(f"starting {len(adapters)} standalone processes", len(adapters))
    processes: list[subprocess.Popen] = []
    try:
        for model_dir, adapter in zip(model_dirs, adapters, strict=True):
            process = subprocess.Popen(
                [sys.executable, "-m", "lorafaas.bench.standalone", str(model_dir), str(adapter), PROMPT,
                 "--hold", "--threads", "1"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )
            processes.append(process)
            assert process.stdout is not None  # (a pipe: asked for above)
            if not process.stdout.readline():
                raise InstanceUnavailable(f"a standalone process exited with code {process.wait()} before a token")
            progress.advance()
        return sum(read_memory(p.pid).pss_bytes for p in processes)
    finally:
        for process in processes:
            if process.stdin is not None:  # (a pipe: asked for above)
                process.stdin.close()
        for process in processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
