"""The baseline: a conventional serverless LLM function, as one fresh process doing everything itself.

    python -m lorafaas.bench.standalone MODEL_DIR ADAPTER_DIR PROMPT [--hold] [--threads N]

imports torch/transformers/peft, loads a private copy of the backbone with `from_pretrained`, wraps it with the
adapter through PEFT, and computes the first token of PROMPT (chat template, greedy). It prints one JSON line with its
step timings as soon as the first token exists; with `--hold` it then waits for a line on stdin before exiting, so a
benchmark can measure the memory of several such processes side by side.
"""

from __future__ import annotations

import json
import sys
import time


def main(argv: list[str]) -> int:
    hold = "--hold" in argv
    args = [a for a in argv if a != "--hold"]
    threads = None
    if "--threads" in args:
        at = args.index("--threads")
        threads = int(args[at + 1])
        del args[at : at + 2]
    if len(args) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    model_dir, adapter_dir, prompt = args
    timings: dict[str, float] = {}
    started = time.perf_counter()

    import torch
    import transformers
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lorafaas.models.reference import chat_input_ids

    if threads:
        torch.set_num_threads(threads)
    transformers.utils.logging.disable_progress_bar()
    timings["libraries"] = time.perf_counter() - started

    mark = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    timings["backbone"] = time.perf_counter() - mark

    mark = time.perf_counter()
    model = PeftModel.from_pretrained(model, adapter_dir).eval()
    timings["adapter"] = time.perf_counter() - mark

    mark = time.perf_counter()
    with torch.inference_mode():
        first = int(model(torch.tensor([chat_input_ids(tokenizer, prompt)])).logits[0, -1].argmax())
    timings["first_token"] = time.perf_counter() - mark

    print(json.dumps({"first_token_id": first, "timings": timings, "total_s": time.perf_counter() - started}),
          flush=True)
    if hold:
        sys.stdin.readline()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
