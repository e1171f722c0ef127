"""Calibrate the `local` cluster to this machine as it is now, from `lorafaas bench throughput` runs.

    python -m lorafaas.replay.calibrate --home HOME [--out local-now.yaml] [--instances 2,4]

The shipped `local.yaml` holds figures of a quiet machine. The live platform shares the 2 cores with whatever else
runs, so before comparing the simulator with a live replay the model is measured again in the same conditions
(`lorafaas bench throughput --json`, each run one fresh one-thread instance of the pirate function; several runs at
once in separate scratch homes whose model stores are hard links of HOME's):

    1 run, --max-tokens 1      8 requests one at a time: each is one prefill of a short bench prompt (t_p)
    1 run, --max-tokens 33     one at a time: t_p + 32 decode steps at batch 1 -> step(1); all 8 at once: 8 prefills
                               + 32 steps at batch 8 -> step(8) -> per extra sequence (step(8) - step(1)) / 7
    k runs at once (k = 2, 4)  the mean one-at-a-time throughput against the single run's -> slowdown(k) with k busy
                               instances; contention c = least squares of slowdown(k) - 1 = c (k - 1)

Prefill keeps the shipped model's shape (base + per prompt token), scaled by t_p over the shipped model's prediction
for the bench prompts; the CPU work of a cold start (libraries, bind) scales by the same ratio. Every other field is
the shipped file's. The result is a cluster YAML for `lorafaas replay --simulate --cluster FILE` and
`python -m lorafaas.replay.compare --cluster FILE`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

import yaml
from rich.console import Console

from lorafaas.errors import InvalidInput
from lorafaas.function_runtime.bench_throughput import PROMPTS

BENCH_REQUESTS = 8
DECODE_STEPS = 32
console = Console(stderr=True)


def _bench(home: Path, scratch: Path, max_tokens: int, copies: int) -> list[dict]:
    """`copies` `lorafaas bench throughput` processes at once, each in its own scratch home; their JSON results."""
    procs = []
    for i in range(copies):
        run_home = scratch / f"k{copies}-{max_tokens}-{i}"
        if not (run_home / "models").exists():
            run_home.mkdir(parents=True)
            shutil.copytree(home / "models", run_home / "models", copy_function=os.link)
        cmd = [sys.executable, "-m", "lorafaas", "--home", str(run_home), "bench", "throughput", "--json",
               "--concurrency", str(BENCH_REQUESTS), "--max-tokens", str(max_tokens)]  # fmt: skip
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
    out = []
    for proc in procs:
        stdout, _ = proc.communicate()
        if proc.returncode != 0:
            raise InvalidInput(f"lorafaas bench throughput exited {proc.returncode}: {stdout[-300:]}")
        out.append(json.loads(stdout))
    return out


def calibrate(home: Path, instances: tuple[int, ...] = (2, 4)) -> dict:
    if not (home / "models" / "smollm2-135m").is_dir():
        raise InvalidInput(f"{home}/models has no smollm2-135m; run `lorafaas --home {home} backbone import` first")
    shipped = yaml.safe_load(resources.files("lorafaas.replay").joinpath("clusters", "local.yaml").read_text())
    steps = [("prefill: 1 instance, 1 token", 1, 1), ("decode: 1 instance, 33 tokens", 33, 1)]
    steps += [(f"contention: {k} instances at once", 33, k) for k in instances]
    results: dict[tuple[int, int], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="lorafaas-calibrate-") as tmp, console.status("") as status:
        for i, (what, max_tokens, copies) in enumerate(steps, 1):
            status.update(f"[{i}/{len(steps)}] lorafaas bench throughput: {what}")
            results[max_tokens, copies] = _bench(home, Path(tmp), max_tokens, copies)
            console.log(
                f"{what}: tokens/s one at a time {[r['tokens_per_s_at_1'] for r in results[max_tokens, copies]]}"
            )
    return derive(results, instances, shipped)


def derive(results: dict[tuple[int, int], list[dict]], instances: tuple[int, ...], shipped: dict) -> dict:
    """The figures from the bench results, keyed by (max tokens, instances at once)."""
    backbone = shipped["backbones"]["smollm2-135m"]
    prefill_s = 1.0 / results[1, 1][0]["tokens_per_s_at_1"]
    single = results[33, 1][0]
    step1 = (33.0 / single["tokens_per_s_at_1"] - prefill_s) / DECODE_STEPS
    step8 = (BENCH_REQUESTS * 33.0 / single["tokens_per_s_at_n"] - BENCH_REQUESTS * prefill_s) / DECODE_STEPS
    slowdowns = {k: single["tokens_per_s_at_1"] / (sum(r["tokens_per_s_at_1"] for r in results[33, k]) / k)
                 for k in instances}  # fmt: skip
    contention = max(0.0, sum((s - 1) * (k - 1) for k, s in slowdowns.items()) / sum((k - 1) ** 2 for k in instances))
    prompt_tokens = sum(len(p.split()) + 1 for p in PROMPTS[:BENCH_REQUESTS]) / BENCH_REQUESTS
    predicted_s = (backbone["prefill_base_ms"] + backbone["prefill_ms_per_token"] * prompt_tokens) / 1e3
    ratio = prefill_s / predicted_s
    return {"prefill_short_s": prefill_s, "prefill_ratio": ratio, "decode_step_1_s": step1, "decode_step_8_s": step8,
            "slowdowns": slowdowns, "contention": contention, "shipped": shipped}  # fmt: skip


def cluster_yaml(measured: dict) -> dict:
    data = measured["shipped"]
    backbone = data["backbones"]["smollm2-135m"]
    ratio = measured["prefill_ratio"]
    backbone["prefill_base_ms"] = round(backbone["prefill_base_ms"] * ratio, 1)
    backbone["prefill_ms_per_token"] = round(backbone["prefill_ms_per_token"] * ratio, 3)
    backbone["decode_ms_per_step"] = round(measured["decode_step_1_s"] * 1e3, 1)
    backbone["decode_ms_per_extra_seq"] = round(max(0.0, measured["decode_step_8_s"] - measured["decode_step_1_s"])
                                                / 7 * 1e3, 2)  # fmt: skip
    for key in ("libraries_s", "bind_s"):
        data["loading"][key] = round(data["loading"][key] * ratio, 4)
    data["contention"] = round(measured["contention"], 3)
    data["device"].pop("cores", None)  # measured as the machine is now: the linear contention, not processor sharing
    data["name"] = "local-now"
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--home", type=Path, default=Path(os.environ.get("LORAFAAS_HOME", "~/.lorafaas")).expanduser())
    parser.add_argument("--out", type=Path, default=Path("local-now.yaml"))
    parser.add_argument("--instances", default="2,4", help="numbers of instances run at once for the contention")
    args = parser.parse_args(argv)
    try:
        instances = tuple(int(k) for k in args.instances.split(","))
        if not instances or any(k < 2 or k > 8 for k in instances):
            raise ValueError
    except ValueError:
        print(f"error: --instances is {args.instances!r}; expected numbers in [2, 8] such as 2,4", file=sys.stderr)
        return 2
    try:
        measured = calibrate(args.home, instances)
    except InvalidInput as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    data = cluster_yaml(measured)
    header = "# `local` calibrated now by python -m lorafaas.replay.calibrate: " + json.dumps(
        {k: v for k, v in measured.items() if k != "shipped"}, default=str
    )
    args.out.write_text(header + "\n" + yaml.safe_dump(data, sort_keys=False))
    print(json.dumps({k: v for k, v in measured.items() if k != "shipped"}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
