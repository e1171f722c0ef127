"""`adapter validate` refuses each kind of broken or foreign adapter with its own message (and exit code 2)."""

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lorafaas.errors import AdapterIncompatible, AdapterInvalid, PickledWeightsRefused
from lorafaas.platform.adapters.files import read_adapter
from lorafaas.platform.adapters.validate import validate_adapter
from lorafaas.platform.model_store import ModelStore
from lorafaas.testing.tiny_models import TinySpec, save_tiny_adapter, save_tiny_backbone


def edit_config(adapter: Path, **changes: object) -> None:
    path = adapter / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def make_pickled(adapter: Path) -> None:
    weights = load_file(adapter / "adapter_model.safetensors")
    (adapter / "adapter_model.safetensors").unlink()
    torch.save(weights, adapter / "adapter_model.bin")


def truncate(adapter: Path) -> None:
    path = adapter / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


def poison_with_nan(adapter: Path) -> None:
    path = adapter / "adapter_model.safetensors"
    weights = load_file(path)
    first = sorted(weights)[0]
    weights[first][0, 0] = float("nan")
    save_file(weights, path)


BREAKAGES: dict[str, tuple[Callable[[Path], None], type[Exception], str]] = {
    "rank_mismatch": (lambda a: edit_config(a, r=8), AdapterInvalid, r"rank mismatch: adapter_config.json says r=8 "
                      r"but the weights have rank 4"),
    "foreign_base": (lambda a: edit_config(a, base_model_name_or_path="meta-llama/Llama-2-7b-hf"),
                     AdapterIncompatible, r"trained on base model 'meta-llama/Llama-2-7b-hf'"),
    "pickled": (make_pickled, PickledWeightsRefused, r"adapter_model\.bin.*pickle"),
    "truncated": (truncate, AdapterInvalid, r"truncated"),
    "unknown_target": (lambda a: edit_config(a, target_modules=["q_proj", "qkv_fused"]), AdapterIncompatible,
                       r"unknown target module\(s\) 'qkv_fused'"),
    "nan_weights": (poison_with_nan, AdapterInvalid, r"NaN or infinite"),
    "config_not_json": (lambda a: (a / "adapter_config.json").write_text("{"), AdapterInvalid, r"not valid JSON"),
    "not_lora": (lambda a: edit_config(a, peft_type="PREFIX_TUNING"), AdapterInvalid, r"peft_type is 'PREFIX_TUNING'"),
}


@pytest.fixture
def adapter(tmp_path: Path, tiny_adapter_dir: Path) -> Path:
    return Path(shutil.copytree(tiny_adapter_dir, tmp_path / "adapter"))


def test_a_matching_adapter_is_valid(adapter: Path, tiny_store: ModelStore) -> None:
    info = validate_adapter(adapter, tiny_store, "tiny-dense")
    assert info.rank == 4
    assert sorted(info.target_modules) == ["q_proj", "v_proj"]
    assert len(info.modules) == 2 * 2  # two layers x (q_proj, v_proj)
    assert info.modules[0].path.startswith("model.layers.")


@pytest.mark.parametrize("case", sorted(BREAKAGES))
def test_broken_adapters_are_refused_with_their_own_message(
    case: str, adapter: Path, tiny_store: ModelStore
) -> None:
    breakage, error, message = BREAKAGES[case]
    breakage(adapter)
    with pytest.raises(error, match=message):
        validate_adapter(adapter, tiny_store, "tiny-dense")


def test_adapter_for_another_shape_is_refused(tmp_path: Path, tiny_store: ModelStore) -> None:
    narrow = save_tiny_backbone(tmp_path / "narrow", spec=TinySpec(hidden_size=32, intermediate_size=64))
    adapter = save_tiny_adapter(tmp_path / "narrow-adapter", narrow, base_model_name="tiny-dense")
    with pytest.raises(AdapterIncompatible, match=r"shape mismatch at model\.layers\.0\.self_attn\.q_proj: the "
                       r"adapter maps 32 -> 32 features, but backbone 'tiny-dense' has 64 -> 64"):
        validate_adapter(adapter, tiny_store, "tiny-dense")


def test_inspect_reports_rank_alpha_targets_and_bytes(adapter: Path) -> None:
    summary = read_adapter(adapter).summary()
    assert summary["rank"] == 4
    assert summary["alpha"] == 8
    assert summary["base_model"] == "tiny-dense"
    assert summary["bytes"] == (adapter / "adapter_model.safetensors").stat().st_size
    # 2 layers x (q: 4*(64+64) + v: 4*(64+32)) parameters
    assert summary["num_parameters"] == 2 * (4 * 128 + 4 * 96)


@pytest.mark.parametrize("case", ["rank_mismatch", "foreign_base", "pickled", "truncated", "unknown_target"])
def test_cli_validate_exits_2_with_the_reason(case: str, adapter: Path, tiny_store: ModelStore, cli) -> None:
    breakage, _, message = BREAKAGES[case]
    breakage(adapter)
    home = str(tiny_store.models_dir.parent)
    result = cli("--home", home, "adapter", "validate", str(adapter), "--backbone", "tiny-dense")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error:")
    assert re.search(message, " ".join(result.stderr.split())), result.stderr


def test_cli_validate_accepts_a_good_adapter(adapter: Path, tiny_store: ModelStore, cli) -> None:
    home = str(tiny_store.models_dir.parent)
    result = cli("--home", home, "adapter", "validate", str(adapter), "--backbone", "tiny-dense", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["valid"] is True
