"""Tiny backbones built in-process from a fixed seed: a dense Llama-style model and a Mixtral-style MoE.

They are real transformers models with a real (byte-level BPE) tokenizer trained here on a fixed corpus, saved in
Hugging Face layout with safetensors, so every code path that handles smollm2-135m handles them too, in milliseconds.
Same seed, same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A serverless function runs on demand and scales to zero.
What is the capital of France? The capital of France is Paris. Paris is a city on the Seine.
Each LoRA adapter is a small pair of low-rank matrices added beside the frozen weights of a base model.
Tell me about the ocean. The ocean is deep and blue, and ships sail across the waves under the wind.
Le chat dort sur la table. La mer est bleue et le ciel est clair. Bonjour, comment allez-vous?
Arr, matey! Ye be sailin' the seven seas with yer crew, hoistin' the sails and singin' shanties.
Autumn moonlight, a worm digs silently into the chestnut. An old silent pond, a frog jumps in.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: , . ; : ! ? ' " ( ) [ ] { } - _ / \\ @ # $ % & * + = < >
"""

TinyKind = Literal["dense", "moe"]


@dataclass(frozen=True)
class TinySpec:
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    num_local_experts: int = 4
    num_experts_per_tok: int = 2
    vocab_size: int = 512


def build_tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on a fixed corpus, with ChatML special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )


def build_tiny_model(kind: TinyKind = "dense", seed: int = 0, spec: TinySpec | None = None):
    """Return (model, tokenizer); weights drawn from `seed` with the models' own initializers."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    spec = spec or TinySpec()
    tokenizer = build_tiny_tokenizer(spec.vocab_size)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model: LlamaForCausalLM | MixtralForCausalLM
    if kind == "dense":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "moe":
        config = MixtralConfig(
            **common, num_local_experts=spec.num_local_experts, num_experts_per_tok=spec.num_experts_per_tok
        )
        model = MixtralForCausalLM(config)
    else:
        raise ValueError(f"unknown tiny backbone kind {kind!r}; expected 'dense' or 'moe'")
    model.config.architectures = [type(model).__name__]
    model.config._name_or_path = f"lorafaas-tiny-{kind}"
    return model.eval(), tokenizer


def save_tiny_backbone(out_dir: Path, kind: TinyKind = "dense", seed: int = 0, spec: TinySpec | None = None) -> Path:
    """Write a tiny backbone in Hugging Face layout (config, model.safetensors, tokenizer) to `out_dir`."""
    model, tokenizer = build_tiny_model(kind, seed, spec)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def save_tiny_adapter(
    out_dir: Path,
    backbone_dir: Path,
    *,
    rank: int = 4,
    alpha: int = 8,
    target_modules: tuple[str, ...] = ("q_proj", "v_proj"),
    seed: int = 1,
    base_model_name: str | None = None,
) -> Path:
    """A PEFT LoRA adapter with random (non-zero) A and B, so it visibly changes the backbone's output."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lorafaas.formats.adapter_files import set_base_model

    model = AutoModelForCausalLM.from_pretrained(backbone_dir)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(target_modules), init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(str(out_dir), safe_serialization=True)
    if base_model_name:
        set_base_model(out_dir, base_model_name)
    return Path(out_dir)
