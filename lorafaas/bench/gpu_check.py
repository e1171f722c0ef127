"""`lorafaas bench gpu-check`: the GPU path on a real card, every check in one run (scripts/gpu-check.sh runs it).

    python -m lorafaas.bench.gpu_check [--device cuda:0] [--dry-run] [--only STEP,...] [--work DIR] [--json FILE]

Steps, in order (each one's figures and verdict land in the JSON and one summary table; a failing step never stops
the ones after it):

    env          the card, torch, the driver
    cuda_tier    the CUDA test tier (tests marked `gpu`, skipped without a GPU) passes, nothing skipped
    synthesize   seeded random backbones of real shapes (SmolLM2-135M in float32 and bf16, Llama 1B in bf16) and
                 adapters, imported through the model store (gpu_models.py)
    platform     `lorafaas up --devices cuda:0`: zero copy (device memory with 1 and 8 functions), speed against
                 transformers + PEFT in one process (1, 8, 32 concurrent), a new function's first token, greedy
                 tokens equal to PEFT's (float32 and bf16, alone and 8 in flight), an attach to the running daemon,
                 the daemon killed while functions serve (gpu_platform_checks.py)
    read_only    a function that writes the backbone through its mapping dies; another's logits are unchanged
    bind_time    a function's attach (lease + import + map) and bind for 135M, 1B and 7B shapes (it makes the 7B
                 shape): flat in size, the transport's part under 20 ms

The platform step comes early: it holds the checks a run must not lose if the machine's time runs out.

`--dry-run` runs every step's plumbing on this machine's CPU with tiny shapes of the same families and a host-memory
stand-in for NVML (CI runs it): what it checks is that each step runs end to end, not the GPU's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import msgspec

from lorafaas.bench.gpu_context import CheckContext, StepResult
from lorafaas.bench.gpu_models import backbone_name, synthesize_adapter, synthesize_backbone
from lorafaas.bench.gpu_platform_checks import run_platform_checks

REPO = Path(__file__).resolve().parents[2]
ATTACH_GOAL_S = 0.020
ATTACH_SAMPLES = 3  # fresh processes per shape (one in a dry run: the plumbing)


def step_env(ctx: CheckContext) -> StepResult:
    import torch

    figures: dict = {"torch": str(torch.__version__), "cuda_available": torch.cuda.is_available(),
                     "python": sys.version}
    if ctx.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(ctx.device)
        figures.update(name=props.name, total_gib=round(props.total_memory / 1024**3, 1),
                       cuda=torch.version.cuda, multiprocessors=props.multi_processor_count)
        summary = f"{props.name}, {figures['total_gib']} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}"
    else:
        summary = f"cpu (dry run), torch {torch.__version__}"
    return StepResult(name="env", ok=True, summary=summary, figures=figures)


def step_cuda_tier(ctx: CheckContext) -> StepResult:
    tests = ["tests/integration/test_cuda_vmm.py", "tests/unit/test_cuda_driver.py",
             "tests/unit/test_engine_fake_cuda.py"]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "--timeout", "300", *tests],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    lines = result.stdout.strip().splitlines()
    closing = lines[-1] if lines else result.stderr[-500:]
    skipped_gpu = [line for line in lines if line.startswith("SKIPPED") and "test_cuda_vmm" in line]
    ok = result.returncode == 0 and (ctx.dry_run or not skipped_gpu)
    error = "" if ok else (result.stdout[-4000:] + result.stderr[-2000:])
    return StepResult(name="cuda_tier", ok=ok, summary=closing, error=error,
                      figures={"returncode": result.returncode, "gpu_tests_skipped": len(skipped_gpu)})


def step_synthesize(ctx: CheckContext) -> StepResult:
    figures = {}
    source = ctx.work / "sources"
    plan = [(ctx.small, "float32"), (ctx.small, "bfloat16"), (ctx.medium, "bfloat16")]  # bind_time makes the largest
    for shape, dtype in plan:
        started = time.perf_counter()
        name = synthesize_backbone(ctx.store, shape, dtype, source, ctx.device)
        figures[name] = {"bytes": ctx.store.get(name).bytes, "seconds": round(time.perf_counter() - started, 1)}
        ctx.log(f"synthesized {name}: {figures[name]}")
    if ctx.device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()  # this process's cached blocks would count as the platform's in NVML's total
    for shape, dtype, count in ((ctx.small, "float32", 3), (ctx.small, "bfloat16", 3), (ctx.medium, "bfloat16", 9)):
        name = backbone_name(shape, dtype)
        ctx.adapters[name] = [synthesize_adapter(ctx.store, name, ctx.work / "adapters" / name / f"a{seed}", seed=seed)
                              for seed in range(count)]
    total = sum(f["bytes"] for f in figures.values())
    return StepResult(name="synthesize", ok=True, figures=figures,
                      summary=f"{len(figures)} backbones ({total / 1e9:.1f} GB), "
                              f"{sum(len(a) for a in ctx.adapters.values())} adapters")


def step_bind_time(ctx: CheckContext) -> StepResult:
    """Every shape's daemon up at once; then fresh processes attach, each with its libraries loaded and its CUDA context
    made before its clock starts (sample_processes), released one at a time."""
    from concurrent.futures import ThreadPoolExecutor

    from lorafaas.bench.daemon import sample_processes
    from lorafaas.protocols.daemon_client import spawn_daemon, stop_daemon
    from lorafaas.protocols.daemon_config import DaemonConfig

    synthesize_backbone(ctx.store, ctx.shapes[2], "bfloat16", ctx.work / "sources", ctx.device)
    names = [backbone_name(shape, "bfloat16") for shape in ctx.shapes]
    configs = {name: DaemonConfig(home=ctx.work / "home", backbone=name, device=ctx.device) for name in names}

    def start(name: str):
        started = time.perf_counter()
        with (ctx.work / f"daemon-{name}.log").open("ab") as log:
            process = spawn_daemon(configs[name], timeout_s=600, stderr=log)
        return process, time.perf_counter() - started

    with ThreadPoolExecutor(len(names)) as pool:
        daemons = dict(zip(names, pool.map(start, names), strict=True))
    try:
        runs = [["attach", str(configs[name].paths.socket), str(ctx.store.path(name)), ctx.device]
                for _ in range(1 if ctx.dry_run else ATTACH_SAMPLES) for name in names]
        samples = sample_processes(runs)
    finally:
        for name, (process, _) in daemons.items():
            stop_daemon(process, configs[name].paths.socket, force=True)
    figures = {}
    for name in names:
        mine = sorted((s for run, s in zip(runs, samples, strict=True) if run[2] == str(ctx.store.path(name))),
                      key=lambda s: s.map_s)
        median = mine[len(mine) // 2]
        figures[name] = {"bytes": ctx.store.get(name).bytes, "daemon_load_s": round(daemons[name][1], 2),
                         "context_ms": round(median.context_s * 1e3, 1),
                         "map_ms": round(median.map_s * 1e3, 2), "bind_ms": round(median.bind_s * 1e3, 2),
                         "attach_ms": round(median.load_s * 1e3, 2),
                         "map_ms_all": [round(s.map_s * 1e3, 2) for s in mine]}
        ctx.log(f"bind time {name}: {figures[name]}")
    ok = ctx.dry_run or figures[names[-1]]["map_ms"] <= ATTACH_GOAL_S * 1e3
    summary = ", ".join(f"{n}: map {f['map_ms']} ms + bind {f['bind_ms']} ms" for n, f in figures.items())
    return StepResult(name="bind_time", ok=ok, summary=summary, figures=figures)


def step_read_only(ctx: CheckContext) -> StepResult:
    from lorafaas.protocols.daemon_client import spawn_daemon, stop_daemon
    from lorafaas.protocols.daemon_config import DaemonConfig
    from lorafaas.testing.attach_probe import ProbeProcess

    name = backbone_name(ctx.small, "float32")
    config = DaemonConfig(home=ctx.work / "home", backbone=name, device=ctx.device)
    with (ctx.work / f"daemon-{name}.log").open("ab") as log:
        daemon = spawn_daemon(config, timeout_s=300, stderr=log)
    try:
        with ProbeProcess(["daemon", str(config.paths.socket), "fn-writer"], timeout_s=300) as writer, \
                ProbeProcess(["daemon", str(config.paths.socket), "fn-reader"], timeout_s=300) as reader:
            before = reader.wait_report()
            writer_report = writer.wait_report()
            writer.send("write")
            writer_exit = writer.wait_exit(120)
            after = reader.request("report")
    finally:
        stop_daemon(daemon, config.paths.socket, force=True)
    ok = (writer_exit not in (0, None) and before.logits_sha256 == after.logits_sha256 and before.params_in_segment
          and writer_report.params_in_segment)
    return StepResult(name="read_only", ok=ok, figures={
        "writer_exit": writer_exit, "reader_logits_unchanged": before.logits_sha256 == after.logits_sha256,
        "params_in_segment": before.params_in_segment and writer_report.params_in_segment},
        summary=f"writer exited {writer_exit}; reader's logits "
                f"{'unchanged' if before.logits_sha256 == after.logits_sha256 else 'CHANGED'}")


STEPS: dict[str, Callable[[CheckContext], StepResult]] = {
    "env": step_env,
    "cuda_tier": step_cuda_tier,
    "synthesize": step_synthesize,
    "platform": run_platform_checks,
    "read_only": step_read_only,
    "bind_time": step_bind_time,
}
NEEDS_SYNTHESIS = {"bind_time", "read_only", "platform"}


def run(ctx: CheckContext, only: set[str] | None = None) -> list[StepResult]:
    results = []
    wanted = [name for name in STEPS if only is None or name in only]
    if any(name in NEEDS_SYNTHESIS for name in wanted) and "synthesize" not in wanted:
        wanted.insert(0, "synthesize")
    for name in wanted:
        ctx.log(f"step {name}")
        started = time.perf_counter()
        try:
            result = STEPS[name](ctx)
        except Exception as exc:  # one step's failure is reported and the others still run
            result = StepResult(name=name, ok=False, summary=f"{type(exc).__name__}: {str(exc)[:200]}",
                                error=traceback.format_exc()[-4000:])
        result.seconds = round(time.perf_counter() - started, 1)
        ctx.log(f"step {name}: {'PASS' if result.ok else 'SKIP' if result.ok is None else 'FAIL'} "
                f"({result.seconds} s) {result.summary}")
        if result.error:
            print(result.error, file=sys.stderr, flush=True)
        results.append(result)
    return results


def summary_table(results: list[StepResult]) -> str:
    rows = ["| step | verdict | seconds | summary |", "|---|---|---|---|"]
    for r in results:
        verdict = "pass" if r.ok else "skipped" if r.ok is None else "FAIL"
        rows.append(f"| {r.name} | {verdict} | {r.seconds} | {r.summary.replace('|', '/')} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lorafaas.bench.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: the plumbing of every step")
    parser.add_argument("--only", default="", help="comma-separated steps (synthesize is added where needed)")
    parser.add_argument("--work", type=Path, default=None, help="scratch directory (default: a new temporary one)")
    parser.add_argument("--json", type=Path, default=Path("gpu-check.json"), help="where every figure is written")
    args = parser.parse_args(argv)
    only = {s.strip() for s in args.only.split(",") if s.strip()} or None
    if only and (unknown := only - set(STEPS)):
        parser.error(f"unknown step(s) {', '.join(sorted(unknown))}; steps: {', '.join(STEPS)}")
    device = "cpu" if args.dry_run else args.device
    work = args.work or _scratch_root() / f"lorafaas-gpu-check-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    ctx = CheckContext(device, work, args.dry_run)
    started = time.perf_counter()
    results = run(ctx, only)
    table = summary_table(results)
    print(table, flush=True)
    report = {"device": device, "dry_run": args.dry_run, "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")),
              "seconds": round(time.perf_counter() - started, 1),
              "commit": _commit(), "steps": [msgspec.to_builtins(r) for r in results]}
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"gpu-check: {sum(bool(r.ok) for r in results)}/{len(results)} steps passed in {report['seconds']} s; "
          f"figures in {args.json}", flush=True)
    return 0 if all(r.ok is not False for r in results) else 1


def _scratch_root() -> Path:
    """/dev/shm where it has room for the 7B shape twice over (source and store: memory-speed writes), else TMPDIR."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 48 * 1024**3:
        return shm
    return Path(os.environ.get("TMPDIR", "/tmp"))


def _commit() -> str:
    if os.environ.get("LORAFAAS_COMMIT"):
        return os.environ["LORAFAAS_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


if __name__ == "__main__":
    sys.exit(main())
