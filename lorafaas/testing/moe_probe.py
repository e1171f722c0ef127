"""A function-instance stand-in for MoE tests and measurements: one process, one expert adapter, local or remote.

    python -m lorafaas.testing.moe_probe --model-dir D --adapter A --mode remote --server SOCK --out OUT.json \
        [--go FILE] [--repeats N]

Loads the backbone, opens the adapter in the given mode (`moe_lora.open_moe_adapter`, what the worker does), waits
until `--go` exists (so several probes run at the same time), runs a fixed batch of prompts `repeats` times and
writes the first run's logits (OUT.safetensors) and a JSON report: the adapter bytes it holds and its memory.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

PROBE_IDS = [[1, 5, 7, 9, 11, 13, 40, 50, 60, 70, 80, 90], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lorafaas.testing.moe_probe")
    parser.add_argument("--model-dir", required=True, type=Path)
    parser.add_argument("--adapter", required=True, type=Path)
    parser.add_argument("--mode", choices=("local", "remote"), required=True)
    parser.add_argument("--server", default=None)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--go", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from lorafaas.function_runtime.memory import read_memory
    from lorafaas.models.lora import attach_adapter
    from lorafaas.models.moe_lora import install_expert_lora, open_moe_adapter

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir).eval()
    gc.collect()
    before = read_memory()
    adapter = open_moe_adapter(args.adapter, args.mode, lora_server=args.server, client=f"probe-{args.mode}")
    install_expert_lora(model, adapter.source, adapter.info)
    attach_adapter(model, adapter.attention)
    gc.collect()
    after = read_memory()
    while args.go is not None and not args.go.exists():
        time.sleep(0.005)
    ids = torch.tensor(PROBE_IDS)
    logits = None
    started = time.perf_counter()
    with torch.inference_mode():
        for _ in range(args.repeats):
            out = model(ids).logits
            logits = out if logits is None else logits
    seconds = time.perf_counter() - started
    if logits is None:
        raise SystemExit("give at least one repeat")
    save_file({"logits": logits.contiguous()}, args.out.with_suffix(".safetensors"))
    report = {
        "mode": args.mode,
        "held_adapter_bytes": adapter.held_bytes,
        "expert_bytes": adapter.info.expert_bytes,
        "attention_bytes": adapter.info.attention_bytes,
        "forward_s": seconds / args.repeats,
        "memory_before_adapter": {"pss": before.pss_bytes, "private": before.private_bytes},
        "memory_after_adapter": {"pss": after.pss_bytes, "private": after.private_bytes},
    }
    args.out.write_text(json.dumps(report))
    adapter.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
