"""Plain transformers + PEFT generation: what a conventional serverless LLM function does.

This is the oracle the runtime's outputs are compared against, the baseline of the benchmarks, and the engine of
`lorafaas demo` until the platform serves the demo functions itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ReferenceOutput:
    text: str
    token_ids: list[int]


ALIGNMENT = 64  # bytes: torch's CPU allocator's, and a divisor of the segment's 256


def load_backbone(model_dir: Path, dtype: str = "float32"):
    """(model, tokenizer) in `dtype` (float32 unless asked) and eval mode, loaded privately from a store entry or any
    HF directory."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    aligned_in_memory(model)
    return model.eval(), tokenizer


def aligned_in_memory(model) -> None:
    """Copy every parameter and buffer that from_pretrained left at an unaligned offset of the checkpoint's mapping.
    A CPU product's result can depend on its operands' alignment (float32 on an AVX-512 AMD EPYC differs in the last
    bit), and a bound model's tensors start at 256-byte offsets of the segment: aligned copies make a private load
    compute what a bound one does. In place on each tensor, so tied weights stay tied."""
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device.type == "cpu" and tensor.numel() and tensor.data_ptr() % ALIGNMENT:
            tensor.data = tensor.data.clone()


def chat_template_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` rendered with the tokenizer's chat template, ready for the assistant's turn."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "input_ids") else ids)  # transformers 5 returns a BatchEncoding


def chat_input_ids(tokenizer, prompt: str) -> list[int]:
    return chat_template_ids(tokenizer, [{"role": "user", "content": prompt}])


def greedy_generate(model, tokenizer, prompt: str, max_new_tokens: int = 48, chat: bool = True) -> ReferenceOutput:
    """Greedy decoding of one prompt; stops at the tokenizer's end-of-turn token."""
    import torch

    ids = chat_input_ids(tokenizer, prompt) if chat else tokenizer(prompt)["input_ids"]
    input_ids = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        )
    new_ids = out[0, len(ids):].tolist()
    return ReferenceOutput(text=tokenizer.decode(new_ids, skip_special_tokens=True).strip(), token_ids=new_ids)


def with_adapter(model, adapter_dir: Path, adapter_name: str = "default"):
    """Wrap `model` with a PEFT LoRA adapter (unmerged). Load more with `peft_model.load_adapter`."""
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(adapter_dir), adapter_name=adapter_name).eval()
