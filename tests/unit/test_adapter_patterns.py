"""Issue 36 finding 10: an adapter's patterns are bounded (count, compile work) and each is compiled once per adapter.

A 26 KB config with 1,000 `alpha_pattern` keys took 15 min 40 s of gateway CPU to deploy: every module matched every
key through a 256-entry global compile cache, which 1,000 keys thrash, so each match compiled its key again.
"""

import json
import shutil
import time
from pathlib import Path

import pytest

from lorafaas.errors import AdapterUnsupported
from lorafaas.formats.adapter_files import read_adapter
from lorafaas.formats.adapter_patterns import MAX_PATTERN_KEYS, MAX_PROGRAM_SIZE
from lorafaas.formats.model_store import ModelStore
from lorafaas.models.adapter_validation import validate_adapter


def edit_config(adapter: Path, **changes: object) -> None:
    path = adapter / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.fixture
def adapter(tmp_path: Path, tiny_adapter_dir: Path) -> Path:
    return Path(shutil.copytree(tiny_adapter_dir, tmp_path / "adapter"))


def test_a_thousand_alpha_pattern_keys_are_refused_at_once_naming_the_field_and_the_limit(
    adapter: Path, tiny_store: ModelStore
) -> None:
    keys = {rf"model\.layers\.{i}\.mlp\.up_prj": 16 for i in range(1000)}  # 26 KB, as the hostile tenant's
    edit_config(adapter, alpha_pattern=keys)
    assert (adapter / "adapter_config.json").stat().st_size > 26_000
    started = time.monotonic()
    with pytest.raises(AdapterUnsupported) as refused:
        validate_adapter(adapter, tiny_store, "tiny-dense")
    assert time.monotonic() - started < 1.0
    assert refused.value.http_status == 422
    assert refused.value.message == (
        f"adapter_config.json: alpha_pattern: 1,000 keys; the limit is {MAX_PATTERN_KEYS} (each is a regular "
        "expression matched against every module)"
    )


def test_keys_that_compile_to_large_programs_are_refused_within_the_compile_budget(
    adapter: Path, tiny_store: ModelStore
) -> None:
    """Each of these compiled in about 6 ms (8,000 RE2 instructions), once per module through the thrashing cache."""
    keys = {rf"[\x{{0}}-\x{{10ffff}}]{{0,999}}k{i}": 8 for i in range(MAX_PATTERN_KEYS)}
    edit_config(adapter, rank_pattern=keys)
    started = time.monotonic()
    with pytest.raises(AdapterUnsupported, match=rf"^adapter_config.json: rank_pattern: the adapter's patterns "
                       rf"compile to more than {MAX_PROGRAM_SIZE:,} RE2 instructions in all"):
        validate_adapter(adapter, tiny_store, "tiny-dense")
    assert time.monotonic() - started < 1.0


def test_one_key_too_large_for_re2_is_refused_in_milliseconds(adapter: Path, tiny_store: ModelStore) -> None:
    """`(.*\\.)?(\\pL{0,200})$` took 210 ms to compile with RE2's default 8 MiB (239,418 instructions)."""
    edit_config(adapter, alpha_pattern={r"\pL{0,200}": 8})
    started = time.monotonic()
    with pytest.raises(AdapterUnsupported, match=r"alpha_pattern: pattern '\\\\pL\{0,200\}' compiles to more than "
                       r"lorafaas's limit of 256 KiB"):
        validate_adapter(adapter, tiny_store, "tiny-dense")
    assert time.monotonic() - started < 0.2


def test_each_key_is_compiled_once_per_adapter(adapter: Path, tiny_store: ModelStore, monkeypatch) -> None:
    import re2

    keys = {rf"unused_{i}": 8 for i in range(MAX_PATTERN_KEYS)}
    edit_config(adapter, alpha_pattern=keys, rank_pattern=keys)
    compiles: list[str] = []
    real_compile = re2.compile
    monkeypatch.setattr(re2, "compile", lambda pattern, options=None: (compiles.append(pattern),
                                                                         real_compile(pattern, options))[1])
    info = validate_adapter(adapter, tiny_store, "tiny-dense")
    assert len(compiles) == len(set(compiles)) == len(info.layout.patterns) == MAX_PATTERN_KEYS, len(compiles)


# The first key (in the file's order: PEFT saves them sorted) whose `(.*\.)?(key)$` matches a module wins.
RANKS = {r"layers\.0\.self_attn\.q_proj": 2, "q_proj": 6, r"self_attn\.v_.*": 3}
ALPHAS = {r"self_attn\.(q|v)_proj": 16, r"layers\.1\..*": 3, "o_proj": 5}


def peft_adapter_at_the_cap(out: Path, backbone_dir: Path) -> tuple[Path, dict[str, tuple[int, float]]]:
    """An adapter saved by PEFT with MAX_PATTERN_KEYS rank_pattern and alpha_pattern keys; each module's rank and
    scaling as PEFT has them when it loads the adapter."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    def at_the_cap(chosen: dict) -> dict:
        fillers = {rf"filler_{i}\.proj": 7 for i in range(MAX_PATTERN_KEYS - len(chosen))}
        first, *rest = chosen.items()
        return {first[0]: first[1], **fillers, **dict(rest)}  # the keys that matter before and after the fillers

    model = AutoModelForCausalLM.from_pretrained(backbone_dir)
    torch.manual_seed(3)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        rank_pattern=at_the_cap(RANKS), alpha_pattern=at_the_cap(ALPHAS), init_lora_weights=False,
                        task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(out, safe_serialization=True)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(backbone_dir), str(out))
    resolved = {
        name.removeprefix("base_model.model."): (module.r["default"], module.scaling["default"])
        for name, module in loaded.named_modules() if hasattr(module, "lora_A") and hasattr(module, "r")
    }
    return out, resolved


def test_a_config_at_the_cap_deploys_and_resolves_as_peft_does(tmp_path: Path, tiny_store: ModelStore) -> None:
    from peft.utils.other import get_pattern_key

    adapter, peft_resolved = peft_adapter_at_the_cap(tmp_path / "at-cap", tiny_store.path("tiny-dense"))
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert len(config["rank_pattern"]) == len(config["alpha_pattern"]) == MAX_PATTERN_KEYS
    started = time.monotonic()
    info = validate_adapter(adapter, tiny_store, "tiny-dense")
    assert time.monotonic() - started < 2.0
    ours = {path: (entry.rank, entry.scaling) for path, entry in info.layout.loras.items()}
    assert ours == peft_resolved
    # A few modules, by PEFT's own matching function: each rule was picked by the key PEFT picks.
    for module, rank, alpha in (("model.layers.0.self_attn.q_proj", 2, 16), ("model.layers.1.self_attn.q_proj", 6, 3),
                                ("model.layers.0.self_attn.v_proj", 3, 16), ("model.layers.1.self_attn.o_proj", 4, 3),
                                ("model.layers.0.self_attn.o_proj", 4, 5), ("model.layers.0.self_attn.k_proj", 4, 8)):
        rank_key = get_pattern_key(config["rank_pattern"].keys(), module)
        alpha_key = get_pattern_key(config["alpha_pattern"].keys(), module)
        assert config["rank_pattern"].get(rank_key, 4) == rank and config["alpha_pattern"].get(alpha_key, 8) == alpha
        assert ours[module] == (rank, alpha / rank), module
    assert read_adapter(adapter).layout.loras == info.layout.loras
