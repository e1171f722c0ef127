"""The GPU check's synthesized backbones have the real models' sizes, and every id they emit decodes to text."""

from __future__ import annotations

import pytest

from lorafaas.bench.gpu_models import FULL_SHAPES, LLAMA_1B, LLAMA_7B, SMOLLM2_135M, padded_tokenizer


@pytest.mark.parametrize(("shape", "parameters"), [
    (SMOLLM2_135M, 134_515_008),  # SmolLM2-135M-Instruct: 538,060,032 bytes of float32 in its safetensors
    (LLAMA_1B, 1_235_814_400),  # Llama-3.2-1B
    (LLAMA_7B, 6_738_415_616),  # Llama-2-7B
])
def test_each_shape_has_its_models_parameter_count(shape, parameters) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**{k: v for k, v in shape.config("bfloat16", 1, 2, 0).items()
                            if k not in ("architectures", "model_type", "torch_dtype")})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == parameters


def test_the_padded_tokenizer_decodes_every_id_of_the_largest_vocabulary() -> None:
    vocab_size = max(shape.vocab_size for shape in FULL_SHAPES)
    tokenizer = padded_tokenizer(vocab_size)
    assert len(tokenizer) == vocab_size
    assert all(tokenizer.decode([i]) for i in (3, 600, 49151, vocab_size - 1))
    assert tokenizer.decode([vocab_size - 1]) == f"<|{vocab_size - 1}|>"
    # the trained part is untouched: ordinary text still tokenizes into the small trained vocabulary
    assert max(tokenizer("the ocean is blue")["input_ids"]) < 512
