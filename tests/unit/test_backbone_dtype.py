"""`lorafaas backbone convert`: a backbone stored in another dtype keeps its identity, rounds every weight as torch
does, and leaves the store as it was on bad input."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lorafaas.errors import AdapterIncompatible, AlreadyExists, BackboneNotFound, InvalidInput
from lorafaas.formats.backbone_dtype import convert_backbone
from lorafaas.formats.model_store import ModelStore
from lorafaas.models.adapter_validation import validate_adapter
from lorafaas.models.reference import load_backbone
from lorafaas.testing.tiny_models import save_tiny_adapter


@pytest.fixture
def store(tmp_path: Path, tiny_dense_dir: Path) -> ModelStore:
    store = ModelStore(tmp_path / "models")
    store.import_dir("tiny", tiny_dense_dir)
    return store


def test_a_bf16_copy_rounds_every_weight_and_keeps_the_sources_identity(store: ModelStore) -> None:
    source = store.get("tiny")
    manifest, created = convert_backbone(store, "tiny-bf16", "tiny", "bfloat16")
    assert created
    assert manifest.dtypes == ("BF16",)
    assert manifest.bytes * 2 == source.bytes and manifest.num_parameters == source.num_parameters
    assert manifest.source == f"convert:tiny@{source.short_hash}:bfloat16"
    assert "tiny" in manifest.base_model_ids and set(source.base_model_ids) <= set(manifest.base_model_ids)
    original = load_file(store.path("tiny") / "model.safetensors")
    copy = load_file(store.path("tiny-bf16") / "model.safetensors")
    assert copy.keys() == original.keys()
    for key, tensor in original.items():
        assert torch.equal(copy[key], tensor.to(torch.bfloat16)), key
    assert json.loads((store.path("tiny-bf16") / "config.json").read_text())["dtype"] == "bfloat16"
    model, _ = load_backbone(store.path("tiny-bf16"), dtype="bfloat16")  # transformers reads it as such
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_converting_again_is_a_no_op_and_a_taken_name_is_refused(store: ModelStore) -> None:
    first, _ = convert_backbone(store, "tiny-bf16", "tiny", "bfloat16")
    again, created = convert_backbone(store, "tiny-bf16", "tiny", "bfloat16")
    assert not created and again == first
    with pytest.raises(AlreadyExists, match="tiny-bf16"):
        convert_backbone(store, "tiny-bf16", "tiny", "float16")
    with pytest.raises(AlreadyExists, match="'tiny'"):
        convert_backbone(store, "tiny", "tiny", "bfloat16")
    assert store.get("tiny-bf16") == first and store.get("tiny").dtypes == ("F32",)


def test_bad_input_is_refused_by_name_and_nothing_is_left_behind(store: ModelStore) -> None:
    with pytest.raises(InvalidInput, match="--dtype is 'int8'"):
        convert_backbone(store, "tiny-int8", "tiny", "int8")
    with pytest.raises(BackboneNotFound):
        convert_backbone(store, "copy", "absent", "bfloat16")
    assert [m.name for m in store.list()] == ["tiny"]
    assert not [p for p in store.models_dir.iterdir() if p.name.startswith(".")], "staging dir left behind"


def test_an_adapter_naming_the_sources_store_path_deploys_on_its_copy(store: ModelStore, tmp_path: Path) -> None:
    """Issue 36 finding 12: PEFT records the path it loaded the backbone from; an adapter trained on the float32
    entry's store path was refused on its bf16 copy ("... is a different model")."""
    convert_backbone(store, "tiny-bf16", "tiny", "bfloat16")
    adapter = save_tiny_adapter(tmp_path / "adapter", store.path("tiny"), base_model_name=str(store.path("tiny")))
    assert validate_adapter(adapter, store, "tiny-bf16").base_model == str(store.path("tiny"))
    store.import_dir("other", store.path("tiny"))  # another entry's path is still another model
    foreign = save_tiny_adapter(tmp_path / "foreign", store.path("tiny"), base_model_name=str(store.path("other")))
    with pytest.raises(AdapterIncompatible, match="is a different model"):
        validate_adapter(foreign, store, "tiny-bf16")
