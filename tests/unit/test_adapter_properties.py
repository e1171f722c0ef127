"""Property: for any PEFT LoRA adapter, deploy's validation refuses it (422, naming the field) or the platform's greedy
output equals PEFT's token for token. Adapters are made by PEFT itself on the tiny seeded backbone, across every
field of LoraConfig that changes inference, then some are edited as a hand-made or foreign adapter would be."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from lorafaas.errors import AdapterInvalid
from lorafaas.function_runtime.engine import EngineConfig, GenerationEngine
from lorafaas.function_runtime.messages import SamplingParams
from lorafaas.models.adapter_validation import validate_adapter
from lorafaas.models.lora import attach_adapter, detach_adapter, read_host_adapter
from lorafaas.models.reference import greedy_generate, load_backbone, with_adapter

LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = "Tell me about the ocean."
MAX_TOKENS = 8


@dataclass(frozen=True)
class Case:
    peft_kwargs: dict  # passed to LoraConfig
    config_edits: dict  # written over the saved adapter_config.json
    dtype: str | None  # the saved factors converted to this dtype, if set
    refused_field: str | None  # the field validation must name, or None if the adapter must run


def targets() -> st.SearchStrategy:
    return st.one_of(
        st.lists(st.sampled_from([*LINEAR, "lm_head"]), min_size=1, max_size=4, unique=True),
        st.sampled_from([r".*\.(q_proj|o_proj)", r"model\.layers\.1\..*_proj", "all-linear", "ALL-LINEAR"]),
    )


@st.composite
def cases(draw) -> Case:
    target = draw(targets())
    kwargs: dict = {
        "r": draw(st.integers(1, 6)),
        "lora_alpha": draw(st.sampled_from([1, 8, 16, 0.5, -3, 12.5])),
        "target_modules": target,
        "use_rslora": draw(st.booleans()),
        "lora_bias": draw(st.booleans()),
        "fan_in_fan_out": draw(st.booleans()),
        "bias": "none",
        "lora_dropout": draw(st.sampled_from([0.0, 0.1])),
        "rank_pattern": draw(st.sampled_from([{}, {"q_proj": 3}, {r"layers\.1\.self_attn\.\w_proj": 2}])),
        "alpha_pattern": draw(st.sampled_from([{}, {"o_proj": 5}, {r"model\.layers\.0\..*": 2.5}])),
        "exclude_modules": draw(st.sampled_from([None, ["k_proj"], r".*layers\.0\.mlp.*"])),
        "modules_to_save": draw(st.sampled_from([None, ["norm"], ["model.norm"], ["post_attention_layernorm"],
                                                 ["lm_head"]])),
    }
    if isinstance(target, list):
        kwargs["layers_to_transform"] = draw(st.sampled_from([None, 0, [1], [0, 1]]))
        kwargs["layers_pattern"] = draw(st.sampled_from([None, "layers"])) if kwargs["layers_to_transform"] else None
    edits = {"init_lora_weights": draw(st.sampled_from([True, False, "gaussian"]))}
    dtype, refused = draw(st.sampled_from([None, None, "float16", "float64", "bfloat16"])), None
    feature = draw(st.sampled_from([None] * 6 + ["use_dora", "embedding", "trainable_token_indices", "int8",
                                                 "layer_replication", "alora", "rank_disagrees", "pissa", "unknown"]))
    if feature == "use_dora":
        kwargs["use_dora"], kwargs["lora_bias"], refused = True, False, "use_dora"
    elif feature == "embedding":
        kwargs["target_modules"] = ["embed_tokens", "q_proj"]
        kwargs.update(layers_to_transform=None, layers_pattern=None, lora_bias=False, exclude_modules=None)
        refused = "target_modules"
    elif feature == "trainable_token_indices":
        kwargs["trainable_token_indices"], kwargs["modules_to_save"] = [1, 7], None
        refused = "trainable_token_indices"
    elif feature == "int8":
        dtype, refused = "int8", "dtype"
    elif feature == "layer_replication":
        edits["layer_replication"], refused = [[0, 2], [1, 2]], "layer_replication"
    elif feature == "alora":
        edits["alora_invocation_tokens"], refused = [3, 4], "alora_invocation_tokens"
    elif feature == "rank_disagrees":
        edits["rank_pattern"], refused = {".*": kwargs["r"] + 1}, "rank_pattern"
    elif feature == "pissa":
        edits["init_lora_weights"], refused = "pissa", "init_lora_weights"
    elif feature == "unknown":
        edits["use_magic"], refused = True, "use_magic"
    if refused is None and isinstance(kwargs["target_modules"], list) and "lm_head" in kwargs["target_modules"]:
        refused = "target_modules"  # PEFT saves a copy of the tied embedding (lm_head.base_layer.weight) with it
    return Case(peft_kwargs=kwargs, config_edits=edits, dtype=dtype, refused_field=refused)


def make_adapter(case: Case, backbone_dir: Path, out: Path, seed: int) -> bool:
    """Save the case's adapter with PEFT; False if PEFT itself refuses the config (nothing to compare then)."""
    from peft import LoraConfig, get_peft_model

    model, _ = load_backbone(backbone_dir)
    torch.manual_seed(seed)
    try:
        peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **case.peft_kwargs))
    except (ValueError, TypeError, NotImplementedError):
        return False
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # make biases and saved copies differ from the backbone, so they show in the output
        for name, parameter in peft_model.named_parameters():
            if ("lora_B" in name and name.endswith(".bias")) or "modules_to_save" in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.5)
    peft_model.save_pretrained(out)
    config_path = out / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config.update(case.config_edits, base_model_name_or_path="tiny-dense")
    config_path.write_text(json.dumps(config))
    if case.dtype:
        weights = load_file(out / "adapter_model.safetensors")
        converted = {k: (t * 8).round().to(torch.int8) if case.dtype == "int8" else t.to(getattr(torch, case.dtype))
                     for k, t in weights.items()}
        if case.dtype in ("float16", "bfloat16"):  # mixed: only the lora_A factors in half precision
            converted = {k: converted[k] if "lora_A" in k else t for k, t in weights.items()}
        save_file(converted, out / "adapter_model.safetensors")
    return True


def platform_ids(model, tokenizer, adapter_dir: Path) -> list[int]:
    attach_adapter(model, read_host_adapter(adapter_dir))
    try:
        engine = GenerationEngine(model, tokenizer, EngineConfig(max_batch_size=1))
        prompt_ids = engine.encode_chat([{"role": "user", "content": PROMPT}])
        engine.add("r", prompt_ids, SamplingParams(max_tokens=MAX_TOKENS))
        ids: list[int] = []
        while engine.has_work():
            ids += [out.token_id for out in engine.step() if out.token_id is not None]
        return ids
    finally:
        detach_adapter(model)


@pytest.fixture(scope="module")
def platform_model(tiny_store):
    return load_backbone(tiny_store.path("tiny-dense"))


# Bounded (30 examples, no shrinking: a failure prints its case) so the test takes well under a minute.
@settings(max_examples=30, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), seed=st.integers(0, 2**16))
def test_every_adapter_is_refused_naming_the_field_or_equals_peft(case: Case, seed: int, tiny_store, platform_model
                                                                 ) -> None:
    backbone_dir = tiny_store.path("tiny-dense")
    with tempfile.TemporaryDirectory() as scratch:
        adapter = Path(scratch)
        if not make_adapter(case, backbone_dir, adapter, seed):
            event("PEFT refuses the config")
            return
        model, tokenizer = platform_model
        try:
            reference = greedy_generate(with_adapter(load_backbone(backbone_dir)[0], adapter), tokenizer, PROMPT,
                                        MAX_TOKENS).token_ids
        except (ValueError, RuntimeError, TypeError, KeyError, IndexError):  # PEFT cannot load it either
            reference = None
        try:
            validate_adapter(adapter, tiny_store, "tiny-dense")
        except AdapterInvalid as exc:
            assert exc.http_status == 422
            event(f"refused: {exc.code}")
            if reference is None:
                return
            assert case.refused_field is not None, f"a supported adapter was refused: {exc.message}"
            assert case.refused_field in exc.message, exc.message
            if case.refused_field != "rank_pattern":  # weights disagreeing with the config are broken, not unsupported
                assert exc.code == "adapter_unsupported", exc.message
            return
        assert reference is not None, "PEFT cannot load this adapter, so deploy must refuse it"
        # The property is "refused naming the field, or equal to PEFT": a case the generator expected to be refused
        # (e.g. LoRA on a tied lm_head that PEFT saved without its base_layer copy) may run, if it runs exactly.
        event("ran: equal to PEFT" if case.refused_field is None else f"ran although {case.refused_field} was expected")
        assert platform_ids(model, tokenizer, adapter) == reference
