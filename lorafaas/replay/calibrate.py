"""Calibrate the `local` cluster's worker model on this machine (the figures `clusters/local.yaml` holds).

    python -m lorafaas.replay.calibrate --home HOME [--backbone smollm2-135m] [--out local-now.yaml]
                                        [--instances 2,3,4] [--repeats 3]

Measures the lorafaas generation engine (`function_runtime/engine.py`) on HOME's backbone (smollm2-135m, or a copy
such as `lorafaas backbone convert`'s bf16 one) with the pirate demo adapter attached, one thread per process, as an
instance runs it:

    prefill passes      b prompts of w tokens prefilled together (b 1, 2, 4, 8; w 40, 90, 160):
                        pass = prefill_base + prefill_per_token x b x w (least squares; the engine pads to w)
    decode steps        rows 1, 4, 8 at 154 tokens of context: step = decode_step + per_extra_seq x (rows - 1)
    interference        k processes decoding at once (k from --instances): their step against one alone, less the
                        share of the cores (max(1, k / cores)); the rest is what each busy core beyond the first
                        costs all: core_interference (shared caches and memory bandwidth)

and writes a cluster YAML: the shipped `local.yaml` with these figures for that backbone (added beside the shipped
one, with its size and KV bytes a token from its files, if it is another; every other field is the shipped file's). Use
it with `lorafaas replay --simulate --cluster FILE` or `python -m lorafaas.replay.compare --cluster FILE`. Run it on
an otherwise idle machine: what else runs is the background the live comparison measures separately
(`lorafaas.replay.cpuload`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

import numpy as np
import yaml
from rich.console import Console

from lorafaas.errors import InvalidInput
from lorafaas.protocols.base_pass import ELEMENT_BYTES
from lorafaas.replay.sim.cluster import load_cluster

PASS_ROWS = (1, 2, 4, 8)
PASS_WIDTHS = (40, 90, 160)
DECODE_ROWS = (1, 4, 8)
DECODE_CONTEXT = 154  # a 128-token replay prompt with the chat template
DECODE_STEPS = 24
ADAPTER = Path(__file__).resolve().parents[2] / "examples" / "adapters" / "pirate"
DEFAULT_BACKBONE = "smollm2-135m"
console = Console(stderr=True)


# -- fits (pure) -----------------------------------------------------------------------------------------------------

def fit_passes(samples: list[tuple[int, int, float]]) -> tuple[float, float]:
    """(base s, s per token) of pass = base + per_token x b x w, from (b, w, seconds)."""
    x = np.array([[1.0, b * w] for b, w, _ in samples])
    y = np.array([s for _, _, s in samples])
    (base, per_token), *_ = np.linalg.lstsq(x, y, rcond=None)
    return max(0.0, float(base)), float(per_token)


def fit_decode(steps: dict[int, float]) -> tuple[float, float]:
    """(step at one row s, s per extra row) from the median step at each number of rows."""
    x = np.array([[1.0, rows - 1] for rows in steps])
    (step1, per_row), *_ = np.linalg.lstsq(x, np.array(list(steps.values())), rcond=None)
    return float(step1), max(0.0, float(per_row))


def fit_interference(slowdowns: dict[int, float], cores: float) -> float:
    """i in slowdown(k) = max(1, k / cores) x (1 + i (min(k, cores) - 1)), least squares over k >= 2."""
    pairs = [(min(k, cores) - 1, s / max(1.0, k / cores) - 1) for k, s in slowdowns.items() if k >= 2]
    num = sum(a * b for a, b in pairs)
    den = sum(a * a for a, _ in pairs)
    return max(0.0, num / den) if den else 0.0


# -- measurements (one engine per process, one thread) ---------------------------------------------------------------

def _engine(model_dir: Path):
    import torch

    torch.set_num_threads(1)
    from lorafaas.function_runtime.engine import EngineConfig, GenerationEngine
    from lorafaas.models.lora import attach_adapter, read_host_adapter
    from lorafaas.models.reference import load_backbone

    model, tokenizer = load_backbone(model_dir)
    attach_adapter(model, read_host_adapter(ADAPTER))
    return GenerationEngine(model, tokenizer, EngineConfig(max_batch_size=max(PASS_ROWS + DECODE_ROWS)))


def _add(engine, name: str, rows: int, width: int, tokens: int) -> None:
    from lorafaas.function_runtime.messages import SamplingParams

    for k in range(rows):
        engine.add(f"{name}-{k}", list(range(100, 100 + width)), SamplingParams(max_tokens=tokens, ignore_eos=True))


def measure_passes(engine, repeats: int) -> list[tuple[int, int, float]]:
    _add(engine, "warm", 1, 40, 1)
    engine.step()
    samples = []
    for r in range(repeats):
        for b in PASS_ROWS:
            for w in PASS_WIDTHS:
                _add(engine, f"p{r}-{b}-{w}", b, w, 1)
                samples.append((b, w, engine.step()[0].prefill_s))
    return samples


def measure_steps(engine, rows_list: tuple[int, ...]) -> dict[int, float]:
    steps: dict[int, float] = {}
    for rows in rows_list:
        _add(engine, f"d{rows}", rows, DECODE_CONTEXT, DECODE_STEPS + 1)
        engine.step()  # the pass
        times = []
        while engine.has_work():
            started = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - started)
        steps[rows] = statistics.median(times)
    return steps


def _steps_together(home: Path, backbone: str, k: int, scratch: Path) -> float:
    """The median one-row step of k processes decoding at the same time (started together once all are loaded)."""
    go = scratch / f"go-{k}"
    cmd = [sys.executable, "-m", "lorafaas.replay.calibrate", "--home", str(home), "--backbone", backbone,
           "--step-worker", str(go)]  # fmt: skip
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(k)]
    try:
        for proc in procs:  # each prints "ready" once its model is loaded
            line = proc.stdout.readline() if proc.stdout else ""
            if line.strip() != "ready":
                raise InvalidInput(f"a decode worker failed to start: {proc.communicate()[1][-300:]}")
        go.touch()
        results = []
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=600)
            if proc.returncode != 0:
                raise InvalidInput(f"a decode worker exited {proc.returncode}: {stderr[-300:]}")
            results.append(float(stdout.strip().splitlines()[-1]))
        return statistics.mean(results)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def _step_worker(model_dir: Path, go: Path) -> int:
    engine = _engine(model_dir)
    print("ready", flush=True)
    while not go.exists():
        time.sleep(0.01)
    print(measure_steps(engine, (1,))[1], flush=True)
    return 0


def calibrate(home: Path, instances: tuple[int, ...], repeats: int, backbone: str = DEFAULT_BACKBONE) -> dict:
    model_dir = home / "models" / backbone
    if not model_dir.is_dir():
        raise InvalidInput(f"{home}/models has no {backbone}; run `lorafaas --home {home} backbone import` first")
    with console.status(f"loading {backbone}") as status:
        engine = _engine(model_dir)
        status.update(f"prefill passes: rows {PASS_ROWS} x widths {PASS_WIDTHS}, {repeats} times")
        passes = measure_passes(engine, repeats)
        status.update(f"decode steps: rows {DECODE_ROWS}")
        steps = measure_steps(engine, DECODE_ROWS)
        del engine
        together = {}
        with tempfile.TemporaryDirectory(prefix="lorafaas-calibrate-") as tmp:
            for k in (1, *instances):
                status.update(f"interference: {k} processes decoding at once")
                together[k] = _steps_together(home, backbone, k, Path(tmp))
                console.log(f"{k} at once: one-row step {together[k] * 1e3:.1f} ms")
    cores = load_cluster("local").cores or 1.0
    base, per_token = fit_passes(passes)
    step1, per_row = fit_decode(steps)
    slowdowns = {k: s / together[1] for k, s in together.items() if k != 1}
    return {"backbone": backbone, **backbone_sizes(model_dir), "prefill_base_s": base,
            "prefill_s_per_token": per_token, "decode_step_s": step1, "decode_step_per_seq_s": per_row,
            "slowdowns": slowdowns,
            "core_interference": fit_interference(slowdowns, cores), "passes": passes, "steps": steps}  # fmt: skip


def backbone_sizes(model_dir: Path) -> dict:
    """The backbone's weights in GB (its safetensors files) and its KV cache's KB a token (keys and values of every
    layer, in the model's dtype, as the runtime keeps them)."""
    config = json.loads((model_dir / "config.json").read_text())
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    element = ELEMENT_BYTES.get(dtype)
    if element is None:
        raise InvalidInput(f"{model_dir}: dtype {dtype!r} is not one the runtime serves")
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_bytes = 2 * config["num_hidden_layers"] * config.get("num_key_value_heads", heads) * head_dim * element
    size = sum(path.stat().st_size for path in model_dir.glob("*.safetensors"))
    return {"size_gb": size / 1e9, "kv_kb_per_token": kv_bytes / 1e3}


def cluster_yaml(measured: dict) -> dict:
    """The shipped `local.yaml` with `measured`'s figures for its backbone (a new entry, shaped as the shipped
    backbone's, for another one)."""
    data = yaml.safe_load(resources.files("lorafaas.replay").joinpath("clusters", "local.yaml").read_text())
    name = measured.get("backbone", DEFAULT_BACKBONE)
    backbone = data["backbones"].setdefault(name, dict(data["backbones"][DEFAULT_BACKBONE]))
    if "size_gb" in measured:
        backbone["size_gb"] = round(measured["size_gb"], 3)
        backbone["kv_kb_per_token"] = round(measured["kv_kb_per_token"], 2)
    backbone["prefill_base_ms"] = round(measured["prefill_base_s"] * 1e3, 1)
    backbone["prefill_ms_per_token"] = round(measured["prefill_s_per_token"] * 1e3, 3)
    backbone["decode_ms_per_step"] = round(measured["decode_step_s"] * 1e3, 1)
    backbone["decode_ms_per_extra_seq"] = round(measured["decode_step_per_seq_s"] * 1e3, 2)
    data["device"]["core_interference"] = round(measured["core_interference"], 3)
    data["name"] = "local-now"
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--home", type=Path, default=Path(os.environ.get("LORAFAAS_HOME", "~/.lorafaas")).expanduser())
    parser.add_argument("--backbone", default=DEFAULT_BACKBONE, help="a backbone of HOME's store")
    parser.add_argument("--out", type=Path, default=Path("local-now.yaml"))
    parser.add_argument("--instances", default="2,3,4", help="numbers of processes decoding at once")
    parser.add_argument("--repeats", type=int, default=3, help="times each prefill pass is measured")
    parser.add_argument("--step-worker", type=Path, help=argparse.SUPPRESS)  # one process of the interference runs
    args = parser.parse_args(argv)
    if args.step_worker is not None:
        return _step_worker(args.home / "models" / args.backbone, args.step_worker)
    try:
        instances = tuple(int(k) for k in args.instances.split(","))
        if not instances or any(k < 2 or k > 8 for k in instances) or not 1 <= args.repeats <= 20:
            raise ValueError
    except ValueError:
        print(f"error: --instances {args.instances!r} must be numbers in [2, 8] such as 2,3,4 and --repeats in "
              f"[1, 20]", file=sys.stderr)  # fmt: skip
        return 2
    try:
        measured = calibrate(args.home, instances, args.repeats, args.backbone)
    except InvalidInput as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    summary = {k: v for k, v in measured.items() if k not in ("passes", "steps")}
    args.out.write_text("# `local` calibrated by python -m lorafaas.replay.calibrate: " + json.dumps(summary)
                        + "\n" + yaml.safe_dump(cluster_yaml(measured), sort_keys=False))  # fmt: skip
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
