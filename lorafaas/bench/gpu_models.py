"""Backbones and adapters for the GPU check, synthesized from seeded random weights (no model can be downloaded there).

Each shape is a real model's configuration (SmolLM2-135M-Instruct's, Llama-3.2-1B's, Llama-2-7B's); the weights are
drawn from a seeded generator on the device that makes them (fast: a 7B shape is 13.5 GB in bf16), written as
safetensors shards in Hugging Face layout with the tests' byte-level BPE tokenizer, and imported through
`ModelStore.import_dir`, the code a user's `lorafaas backbone import` runs. The tokenizer's vocabulary is smaller
than the shapes': the check compares token ids (`return_tokens_as_token_ids`), never text.

`--dry-run` uses the same code on tiny shapes of the same families.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from lorafaas.formats.model_store import ModelStore
from lorafaas.testing.synthetic_adapters import write_random_adapter

SHARD_BYTES = 4 * 1024**3  # as from_pretrained's save_pretrained shards (5 GB there; smaller keeps host copies small)


@dataclass(frozen=True)
class Shape:
    """A Llama-family configuration, as config.json fields."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096

    def config(self, dtype: str, bos: int, eos: int, pad: int) -> dict:
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings, "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps, "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02, "torch_dtype": dtype,
            "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad,
        }


SMOLLM2_135M = Shape("smollm2-135m", 576, 1536, 30, 9, 3, 49152, True, rope_theta=100000.0)
LLAMA_1B = Shape("llama-1b", 2048, 8192, 16, 32, 8, 128256, True, rope_theta=500000.0)
LLAMA_7B = Shape("llama-7b", 4096, 11008, 32, 32, 32, 32000, False)
FULL_SHAPES = (SMOLLM2_135M, LLAMA_1B, LLAMA_7B)
# The dry run's stand-ins: the same families, sizes growing the same way, small enough for two CPU cores.
DRY_SHAPES = (
    replace(SMOLLM2_135M, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1024),
    replace(LLAMA_1B, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=2048),
    replace(LLAMA_7B, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=2048),
)


def backbone_name(shape: Shape, dtype: str) -> str:
    return f"{shape.name}-{'bf16' if dtype == 'bfloat16' else 'fp32'}"


def synthesize_backbone(store: ModelStore, shape: Shape, dtype: str, work: Path, device: str, seed: int = 0) -> str:
    """Write `shape` with seeded random weights in `dtype` under `work`, import it into `store` (the source is removed
    once the store holds its own copy); its store name."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    name = backbone_name(shape, dtype)
    if store.exists(name):
        return name
    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = padded_tokenizer(shape.vocab_size)
    tokenizer.save_pretrained(out)
    config = shape.config(dtype, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    with torch.device("meta"):  # names and shapes only
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out))
    generator = torch.Generator(device=device).manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    shards: list[dict[str, torch.Tensor]] = [shard]
    size = 0
    for key, meta in model.state_dict().items():
        if shape.tie_word_embeddings and key == "lm_head.weight":
            continue  # tied: the checkpoint holds the embedding only, as from_pretrained's do
        if key.endswith("norm.weight"):
            value = torch.ones(meta.shape, device=device)
        else:
            value = torch.randn(meta.shape, generator=generator, device=device) * 0.02
        value = value.to(getattr(torch, dtype)).cpu()
        if size and size + value.nbytes > SHARD_BYTES:
            shard, size = {}, 0
            shards.append(shard)
        shard[key] = value
        size += value.nbytes
    if len(shards) == 1:
        save_file(shard, out / "model.safetensors", metadata={"format": "pt"})
    else:  # sharded as save_pretrained shards, with the index from_pretrained reads
        weight_map = {}
        for index, tensors in enumerate(shards):
            file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(tensors, out / file, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, file))
        index_json = {"metadata": {"total_size": sum(t.nbytes for s in shards for t in s.values())},
                      "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2) + "\n")
    store.import_dir(name, out)
    shutil.rmtree(out)
    return name


def padded_tokenizer(vocab_size: int):
    """The tests' byte-level BPE tokenizer (trained on a fixed corpus: a few hundred tokens) with its vocabulary filled
    up to `vocab_size` by plain entries `<|N|>`, so every id a random backbone emits decodes to text, as with a real
    tokenizer. Ordinary BPE entries, not added tokens: it loads as fast as a real tokenizer of that size."""
    import json as json_module

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from lorafaas.testing.tiny_models import build_tiny_tokenizer

    tiny = build_tiny_tokenizer()
    document = json_module.loads(tiny.backend_tokenizer.to_str())
    vocab = document["model"]["vocab"]
    taken = set(vocab) | {t["content"] for t in document["added_tokens"]}
    ids = set(vocab.values()) | {t["id"] for t in document["added_tokens"]}
    for token_id in range(vocab_size):
        if token_id not in ids and (token := f"<|{token_id}|>") not in taken:
            vocab[token] = token_id
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json_module.dumps(document)),
                                   bos_token=tiny.bos_token, eos_token=tiny.eos_token, pad_token=tiny.pad_token,
                                   unk_token=tiny.unk_token, chat_template=tiny.chat_template)


def synthesize_adapter(store: ModelStore, backbone: str, out: Path, seed: int, rank: int = 16,
                       target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")) -> Path:
    """A PEFT LoRA adapter with seeded random A and B (B non-zero, so it changes the output) for `backbone`."""
    return write_random_adapter(out, store, backbone, rank=rank, alpha=2 * rank, target_modules=target_modules,
                                seed=seed, scale=0.05)
