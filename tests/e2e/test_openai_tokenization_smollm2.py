"""A raw completion prompt is tokenized as vLLM tokenizes it (add_special_tokens=True), on the real smollm2-135m.

SmolLM2's tokenizer adds no special token to a text (no BOS, no EOS): with or without them the ids are the same, so
the platform's prompt token counts on SmolLM2 did not change when it moved to vLLM's rule.
`tests/integration/test_openai_parity.py` shows the rule on a tokenizer that does add a BOS.
"""

import pytest

from lorafaas.function_runtime.engine import GenerationEngine
from lorafaas.models.reference import load_backbone

PROMPTS = ["Tell me about the ocean.", "<|im_start|>user\nHi<|im_end|>", " leading space", "über 42"]


@pytest.fixture(scope="module")
def engine(smollm2_store) -> GenerationEngine:
    model, tokenizer = load_backbone(smollm2_store.path("smollm2-135m"))
    return GenerationEngine(model, tokenizer)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_the_engine_tokenizes_a_raw_prompt_as_vllm(engine, prompt) -> None:
    vllm_rule = engine.tokenizer(prompt, add_special_tokens=True)["input_ids"]
    assert engine.encode_text(prompt) == vllm_rule
    assert vllm_rule == engine.tokenizer(prompt, add_special_tokens=False)["input_ids"], "SmolLM2 adds none"
