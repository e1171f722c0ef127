"""`lorafaas bench attach`: how much faster a function starts on a shared backbone than with a private copy.

Each sample is a fresh process (`python -m lorafaas.bench.daemon private|attach ...`). Library loading
(torch, transformers, the architecture's modeling module, lorafaas) is a separate artifact in lorafaas' cost model,
so both kinds of process import the same libraries first and time only the backbone:

    private_load_s  AutoModelForCausalLM.from_pretrained(store entry, float32)
    attach_s        connect to the daemon + lease + map the segment + build the empty model + bind
    bind_s          the binding alone (assign shared tensors, tie, rotary buffers, checks)

The two kinds alternate, `repeats` of each, and the medians are reported. A daemon already serving the backbone on
the CPU is used as is; otherwise one is started for the run and stopped after it.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from lorafaas.config import LorafaasConfig
from lorafaas.errors import DaemonUnavailable, ServerError
from lorafaas.formats.model_store import ModelStore
from lorafaas.progress import ProgressSink, SilentProgress
from lorafaas.protocols.daemon_client import DaemonClient, spawn_daemon, stop_daemon, wait_until_ready
from lorafaas.protocols.daemon_config import DaemonConfig
from lorafaas.testing.child_process import stderr_tail

SAMPLE_TIMEOUT_S = 600.0


class AttachBenchResult(msgspec.Struct, frozen=True, kw_only=True):
    backbone: str
    bytes: int
    private_load_s: float
    attach_s: float
    bind_s: float
    ratio_private_over_attach: float


class BenchSample(msgspec.Struct, frozen=True, kw_only=True):
    """What one fresh process reports on stdout."""

    mode: str
    load_s: float  # private: from_pretrained; attach: lease + map + empty model + bind
    bind_s: float = 0.0
    map_s: float = 0.0  # attach: connect + lease + map the segment (the transport's part)
    context_s: float = 0.0  # attach on a GPU: the process's CUDA context, made before the clock starts


def run_attach_bench(
    home: Path, backbone: str, repeats: int = 5, progress: ProgressSink | None = None
) -> AttachBenchResult:
    progress = progress or SilentProgress()
    if repeats < 1:
        raise ValueError(f"repeats is {repeats}; it must be at least 1")
    store = ModelStore(LorafaasConfig(home=Path(home)).models_dir)
    manifest = store.get(backbone)
    model_dir = store.path(backbone)
    config = DaemonConfig(home=Path(home), backbone=backbone, device="cpu")
    daemon = None
    try:
        wait_until_ready(config.paths.socket, timeout_s=0.5)
    except DaemonUnavailable:
        progress.stage(f"starting a daemon for {backbone}")
        daemon = spawn_daemon(config)
    try:
        progress.stage(f"{repeats} private loads and {repeats} attaches, each in a fresh process", 2 * repeats)
        private, attached = [], []
        for _ in range(repeats):
            private.append(sample_process(["private", str(model_dir)]))
            progress.advance()
            attached.append(sample_process(["attach", str(config.paths.socket), str(model_dir)]))
            progress.advance()
    finally:
        if daemon is not None:
            stop_daemon(daemon, config.paths.socket, force=True)
    private_s = statistics.median(s.load_s for s in private)
    attach_s = statistics.median(s.load_s for s in attached)
    return AttachBenchResult(
        backbone=backbone, bytes=manifest.bytes, private_load_s=private_s, attach_s=attach_s,
        bind_s=statistics.median(s.bind_s for s in attached), ratio_private_over_attach=private_s / attach_s,
    )


def sample_process(args: list[str]) -> BenchSample:
    """Run one fresh `python -m lorafaas.bench.daemon private|attach ...` process; its report."""
    return sample_processes([args])[0]


def sample_processes(runs: list[list[str]]) -> list[BenchSample]:
    """Fresh processes started together: each imports its libraries (and makes its CUDA context) at once, then waits;
    they are released one at a time, so each timed part runs alone while the slow imports overlap. Reports in order."""
    with contextlib.ExitStack() as stack:
        errors = [stack.enter_context(tempfile.TemporaryFile()) for _ in runs]  # a pipe could fill and block it
        processes = [subprocess.Popen([sys.executable, "-m", "lorafaas.bench.daemon", "--wait", *args],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
                     for args, err in zip(runs, errors, strict=True)]
        try:
            for args, process, err in zip(runs, processes, errors, strict=True):  # every one ready before any goes
                assert process.stdout is not None  # (a pipe: asked for above)
                if process.stdout.readline().strip() != b"ready":
                    raise ServerError(f"bench process `{args[0]}` exited with {process.wait()} before it was ready: "
                                      f"{stderr_tail(err)}")
            samples = []
            for args, process, err in zip(runs, processes, errors, strict=True):
                out, _ = process.communicate(b"go\n", timeout=SAMPLE_TIMEOUT_S)
                if process.returncode != 0:
                    raise ServerError(f"bench process `{args[0]}` exited with {process.returncode}: {stderr_tail(err)}")
                samples.append(msgspec.json.decode(out.strip().splitlines()[-1], type=BenchSample))
            return samples
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()



# --- the fresh processes


def _import_libraries(model_dir: Path) -> None:
    """What both kinds of process load before the clock starts: the libraries, not the backbone."""
    import torch  # noqa: F401
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING


    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(model_dir))]  # imports the modeling module


def _private(model_dir: Path) -> BenchSample:
    import torch
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return BenchSample(mode="private", load_s=time.perf_counter() - started)


def _cuda_context(device: str) -> float:
    """Make this process's CUDA context on `device` (every process that uses a GPU pays it once, whatever it maps);
    the seconds it took."""
    import torch

    started = time.perf_counter()
    torch.cuda.init()
    torch.empty(1, device=device)
    torch.cuda.synchronize(device)
    return time.perf_counter() - started


def _attach(socket_path: Path, model_dir: Path, device: str = "cpu", wait: bool = False) -> BenchSample:
    from lorafaas.models.binding import bind_backbone, build_empty_model

    context_s = _cuda_context(device) if device.startswith("cuda") else 0.0
    if wait:
        _wait_for_go()
    started = time.perf_counter()
    client = DaemonClient.connect(socket_path, client="bench")
    attached = client.attach(f"bench-{os.getpid()}")
    attachment = attached.map()
    mapped = time.perf_counter()
    model = build_empty_model(model_dir)
    bind_started = time.perf_counter()
    bind_backbone(attachment, model_dir, model=model)
    done = time.perf_counter()
    client.detach(attached.lease_id)
    client.close()
    return BenchSample(mode="attach", load_s=done - started, bind_s=done - bind_started, map_s=mapped - started,
                       context_s=context_s)


def _wait_for_go() -> None:
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        sys.exit("bench: released without 'go'")


def main(argv: list[str]) -> None:
    """`[--wait] private MODEL_DIR` or `[--wait] attach SOCKET MODEL_DIR [DEVICE]` (DEVICE cuda:N: the CUDA context is
    made first). --wait: say `ready` once the libraries are loaded, start the clock on a `go` line."""
    wait = argv[:1] == ["--wait"]
    mode, *args = argv[1:] if wait else argv
    _import_libraries(Path(args[0] if mode == "private" else args[1]))
    if mode == "private":
        if wait:
            _wait_for_go()
        sample = _private(Path(args[0]))
    else:
        sample = _attach(Path(args[0]), Path(args[1]), args[2] if len(args) > 2 else "cpu", wait=wait)
    sys.stdout.buffer.write(msgspec.json.encode(sample) + b"\n")


if __name__ == "__main__":
    main(sys.argv[1:])
