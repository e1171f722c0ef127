import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lorafaas.errors import AlreadyExists, BackboneNotFound, InvalidName, MalformedModel, PickledWeightsRefused
from lorafaas.formats.model_store import MANIFEST_FILE, ModelStore
from lorafaas.formats.weights import read_safetensors_header
from lorafaas.progress import SilentProgress


@pytest.fixture
def store(tmp_path: Path) -> ModelStore:
    return ModelStore(tmp_path / "models")


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_import_writes_hf_layout_and_manifest(store: ModelStore, tiny_dense_dir: Path) -> None:
    manifest, created = store.import_dir("tiny", tiny_dense_dir)
    assert created
    entry = store.path("tiny")
    for name in ("config.json", "model.safetensors", "tokenizer.json", MANIFEST_FILE):
        assert (entry / name).is_file(), name
    header = read_safetensors_header(entry / "model.safetensors")
    assert manifest.num_parameters == header.num_parameters
    assert manifest.bytes == header.num_bytes
    assert manifest.architecture == "LlamaForCausalLM"
    assert len(manifest.weights_sha256) == 64
    assert store.get("tiny") == manifest
    assert [m.name for m in store.list()] == ["tiny"]
    assert not [p for p in store.models_dir.iterdir() if p.name.startswith(".")], "staging dir left behind"


def test_stored_backbone_loads_with_transformers(store: ModelStore, tiny_dense_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    store.import_dir("tiny", tiny_dense_dir)
    model = AutoModelForCausalLM.from_pretrained(store.path("tiny"))
    reference = AutoModelForCausalLM.from_pretrained(tiny_dense_dir)
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(model(ids).logits, reference(ids).logits)


def test_second_import_of_same_weights_is_a_noop(store: ModelStore, tiny_dense_dir: Path) -> None:
    first, _ = store.import_dir("tiny", tiny_dense_dir)
    second, created = store.import_dir("tiny", tiny_dense_dir)
    assert not created
    assert second == first


def test_different_weights_under_a_taken_name_are_refused(
    store: ModelStore, tiny_dense_dir: Path, tiny_moe_dir: Path
) -> None:
    original, _ = store.import_dir("tiny", tiny_dense_dir)
    with pytest.raises(AlreadyExists, match="already exists with different weights"):
        store.import_dir("tiny", tiny_moe_dir)
    assert store.get("tiny") == original


def test_pickled_only_weights_are_refused(store: ModelStore, tiny_dense_dir: Path, tmp_path: Path) -> None:
    src = copy_of(tiny_dense_dir, tmp_path / "pickled")
    (src / "model.safetensors").unlink()
    torch.save({"w": torch.zeros(2)}, src / "pytorch_model.bin")
    with pytest.raises(PickledWeightsRefused, match=r"pytorch_model\.bin.*safetensors only"):
        store.import_dir("pickled", src)
    assert store.list() == []
    assert not store.models_dir.exists() or not any(store.models_dir.iterdir())


def test_sharded_weights_are_imported_whole(store: ModelStore, tiny_dense_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    src = copy_of(tiny_dense_dir, tmp_path / "sharded")
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    (src / "model.safetensors").unlink()
    save_file({n: tensors[n] for n in names[:half]}, src / "model-00001-of-00002.safetensors")
    save_file({n: tensors[n] for n in names[half:]}, src / "model-00002-of-00002.safetensors")
    manifest, _ = store.import_dir("sharded", src)
    assert manifest.weight_files == ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    assert manifest.num_parameters == sum(t.numel() for t in tensors.values())


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (lambda d: (d / "config.json").unlink(), "no config.json"),
        (lambda d: (d / "config.json").write_text("{not json"), "not valid JSON"),
        (lambda d: (d / "config.json").write_text(json.dumps({"architectures": ["BertModel"]})), "ForCausalLM"),
        (lambda d: (d / "tokenizer.json").unlink(), "no tokenizer"),
        (lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 4), "too short"),
    ],
)
def test_malformed_directories_are_refused_and_leave_nothing(
    store: ModelStore, tiny_dense_dir: Path, tmp_path: Path, breakage, message: str
) -> None:
    src = copy_of(tiny_dense_dir, tmp_path / "broken")
    breakage(src)
    with pytest.raises(MalformedModel, match=message):
        store.import_dir("broken", src)
    assert store.list() == []
    assert not store.models_dir.exists() or not any(store.models_dir.iterdir())


@pytest.mark.parametrize("name", ["", "UPPER", "has space", "-lead", "trail-", "a/b", "../x", "x" * 64])
def test_invalid_names_are_refused(store: ModelStore, tiny_dense_dir: Path, name: str) -> None:
    with pytest.raises(InvalidName):
        store.import_dir(name, tiny_dense_dir)


def test_unknown_backbone_names_the_imported_ones(store: ModelStore, tiny_dense_dir: Path) -> None:
    store.import_dir("tiny", tiny_dense_dir)
    with pytest.raises(BackboneNotFound, match=r"'nope'.*imported: tiny"):
        store.get("nope")


def test_importing_a_store_entry_keeps_the_names_its_manifest_recorded(
    store: ModelStore, tiny_dense_dir: Path, tmp_path: Path
) -> None:
    # A GGUF import records the hub id, which config.json does not carry; adapters name the backbone by it.
    with store.staging("first") as staging:
        for path in tiny_dense_dir.iterdir():
            shutil.copy2(path, staging / path.name)
        first = store.finalize(staging, "first", source="test", base_model_ids=("Org/Tiny-Model",),
                               progress=SilentProgress())
    other = ModelStore(tmp_path / "other")
    copied, _ = other.import_dir("again", store.path(first.name))
    assert copied.base_model_ids[0] == "Org/Tiny-Model"
    assert "first" in copied.base_model_ids  # the folder's name, as for any directory
