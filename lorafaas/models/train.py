"""LoRA fine-tuning with PEFT on the CPU: a small, deterministic trainer for adapters built from JSONL chat data.

Each JSONL line is {"prompt": ..., "response": ...} or {"messages": [{"role", "content"}, ...]} whose last message
is the assistant's. The loss covers the response tokens only (and the end-of-turn token, so the adapter learns to
stop).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from lorafaas.errors import InvalidInput
from lorafaas.formats.adapter_files import set_base_model
from lorafaas.formats.model_store import ModelStore
from lorafaas.progress import ProgressSink, SilentProgress

TRAIN_RECORD_FILE = "lorafaas-train.json"
IGNORE_INDEX = -100


@dataclass(frozen=True)
class TrainConfig:
    rank: int = 8
    alpha: int = 16
    steps: int = 200
    batch_size: int = 4
    learning_rate: float = 1e-3
    max_seq_len: int = 256
    seed: int = 0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __post_init__(self) -> None:
        for field_name in ("rank", "alpha", "steps", "batch_size", "max_seq_len"):
            if getattr(self, field_name) <= 0:
                raise InvalidInput(f"{field_name} must be positive, got {getattr(self, field_name)}")
        if not 0 < self.learning_rate < 1:
            raise InvalidInput(f"learning_rate must be in (0, 1), got {self.learning_rate}")


@dataclass(frozen=True)
class TrainResult:
    out_dir: Path
    first_loss: float
    final_loss: float
    seconds: float


def read_examples(data: Path) -> list[list[dict[str, str]]]:
    """Each example as a chat: a list of messages ending with the assistant's answer."""
    data = Path(data)
    if not data.is_file():
        raise InvalidInput(f"training data {data} does not exist")
    examples = []
    for line_no, line in enumerate(data.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidInput(f"{data}:{line_no}: not valid JSON ({exc.msg})") from exc
        examples.append(_as_messages(row, f"{data}:{line_no}"))
    if not examples:
        raise InvalidInput(f"{data} has no examples")
    return examples


def _as_messages(row: object, where: str) -> list[dict[str, str]]:
    if isinstance(row, dict) and isinstance(row.get("prompt"), str) and isinstance(row.get("response"), str):
        return [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}]
    if isinstance(row, dict) and isinstance(row.get("messages"), list):
        messages = row["messages"]
        ok = all(isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") for m in messages)
        if ok and messages and messages[-1]["role"] == "assistant":
            return [{"role": m["role"], "content": m["content"]} for m in messages]
    raise InvalidInput(
        f"{where}: expected {{\"prompt\": str, \"response\": str}} or {{\"messages\": [...]}} ending with an "
        "assistant message"
    )


def encode_example(tokenizer, messages: list[dict[str, str]], max_seq_len: int) -> tuple[list[int], list[int]]:
    """Token ids and labels; labels mask the prompt so only the answer is learned."""
    from lorafaas.models.reference import chat_template_ids

    prompt_ids = chat_template_ids(tokenizer, messages[:-1])
    answer_ids = tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"]
    answer_ids = [*answer_ids, tokenizer.eos_token_id]
    ids = (list(prompt_ids) + answer_ids)[:max_seq_len]
    labels = ([IGNORE_INDEX] * len(prompt_ids) + answer_ids)[:max_seq_len]
    return ids, labels


def train_adapter(
    store: ModelStore,
    backbone: str,
    data: Path,
    out_dir: Path,
    config: TrainConfig | None = None,
    progress: ProgressSink | None = None,
) -> TrainResult:
    config = config or TrainConfig()
    progress = progress or SilentProgress()
    manifest = store.get(backbone)
    examples = read_examples(data)
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise InvalidInput(f"output directory {out_dir} is not empty; choose another --out or remove it")

    progress.stage("loading backbone")
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    started = time.perf_counter()
    torch.manual_seed(config.seed)
    model_dir = store.path(backbone)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = LoraConfig(
        r=config.rank, lora_alpha=config.alpha, target_modules=list(config.target_modules), lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, lora)
    peft_model.train()
    encoded = [encode_example(tokenizer, m, config.max_seq_len) for m in examples]
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=config.learning_rate)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, config.steps))
    order = torch.Generator().manual_seed(config.seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    progress.stage(f"training rank-{config.rank} LoRA on {len(examples)} examples", config.steps)
    losses: list[float] = []
    permutation: list[int] = []
    for _ in range(config.steps):
        batch = []
        for _ in range(min(config.batch_size, len(encoded))):
            if not permutation:
                permutation = torch.randperm(len(encoded), generator=order).tolist()
            batch.append(encoded[permutation.pop()])
        input_ids, labels, attention = _collate(batch, pad_id)
        loss = peft_model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        progress.advance(1)

    progress.stage(f"saving adapter to {out_dir}")
    peft_model.save_pretrained(str(out_dir), safe_serialization=True)
    set_base_model(out_dir, manifest.name)
    for path in out_dir.iterdir():  # safetensors writes 0600; platform processes of other users must read it
        path.chmod(0o644)
    (out_dir / "README.md").unlink(missing_ok=True)  # PEFT's model-card stub says nothing true about this adapter
    first_loss, final_loss = round(losses[0], 4), round(sum(losses[-10:]) / len(losses[-10:]), 4)
    record = {
        "backbone": manifest.name,
        "backbone_sha256": manifest.weights_sha256,
        "data": Path(data).name,
        "data_sha256": hashlib.sha256(Path(data).read_bytes()).hexdigest(),
        "num_examples": len(examples),
        "config": {**asdict(config), "target_modules": list(config.target_modules)},
        "first_loss": first_loss,
        "final_loss": final_loss,
    }
    (out_dir / TRAIN_RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return TrainResult(out_dir, first_loss, final_loss, time.perf_counter() - started)


def _lr_factor(step: int, total: int) -> float:
    warmup = max(1, total // 20)
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def _collate(batch: list[tuple[list[int], list[int]]], pad_id: int):
    import torch

    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (ids, labs) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(labs)] = torch.tensor(labs)
        attention[row, : len(ids)] = 1
    return input_ids, labels, attention
