"""`adapter validate` refuses each kind of broken or foreign adapter with its own message (and exit code 2)."""

import json
import re
import shutil
import struct
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lorafaas.errors import AdapterIncompatible, AdapterInvalid, PickledWeightsRefused
from lorafaas.formats.adapter_files import read_adapter
from lorafaas.formats.model_store import ModelStore
from lorafaas.models.adapter_validation import validate_adapter
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


# -- issue 18: hostile and odd adapters (items 1, 6, 11) -----------------------------------------------------------


def edit_weights(adapter: Path, change: Callable[[dict], dict]) -> None:
    path = adapter / "adapter_model.safetensors"
    save_file(change(load_file(path)), path)


def raw_safetensors(adapter: Path, header: dict, data: bytes) -> None:
    encoded = json.dumps(header).encode()
    (adapter / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def overlapping_offsets(adapter: Path) -> None:
    tensors = load_file(adapter / "adapter_model.safetensors")
    header, offset = {}, 0
    for name, tensor in sorted(tensors.items()):
        size = tensor.numel() * 4
        header[name] = {"dtype": "F32", "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size // 2  # each tensor starts halfway into the one before
    raw_safetensors(adapter, header, b"\0" * (offset + size))


def trailing_bytes(adapter: Path) -> None:
    with (adapter / "adapter_model.safetensors").open("ab") as f:
        f.write(b"\0" * 64)


def rank_zero(adapter: Path) -> None:
    edit_weights(adapter, lambda t: {**t, **{k: v[:0] if ".lora_A." in k else v[:, :0] for k, v in t.items()
                                             if "layers.0.self_attn.q_proj" in k}})


def first_module_only(tensors: dict) -> dict:
    return {k: v for k, v in tensors.items() if "layers.0.self_attn.q_proj" in k}


HOSTILE: dict[str, tuple[Callable[[Path], None], str, str]] = {
    # case: (breakage, error code, words the message must hold)
    "invalid_regex": (lambda a: edit_config(a, target_modules="(q_proj"), "adapter_unsupported", "target_modules"),
    "lookahead_regex": (lambda a: edit_config(a, target_modules=r"(?=.*q).*_proj"), "adapter_unsupported",
                        "target_modules"),
    "alpha_string": (lambda a: edit_config(a, lora_alpha="16"), "adapter_invalid", "lora_alpha"),
    "alpha_word": (lambda a: edit_config(a, lora_alpha="abc"), "adapter_invalid", "lora_alpha"),
    "alpha_null": (lambda a: edit_config(a, lora_alpha=None), "adapter_invalid", "lora_alpha"),
    "alpha_list": (lambda a: edit_config(a, lora_alpha=[16]), "adapter_invalid", "lora_alpha"),
    "alpha_nan": (lambda a: edit_config(a, lora_alpha=float("nan")), "adapter_invalid", "lora_alpha"),
    "alpha_huge": (lambda a: edit_config(a, lora_alpha=1e300), "adapter_invalid", "lora_alpha"),
    "trailing_bytes": (trailing_bytes, "adapter_invalid", "trailing bytes"),
    "overlapping_offsets": (overlapping_offsets, "adapter_invalid", "overlaps"),
    "rank_zero": (rank_zero, "adapter_invalid", "rank 0"),
    "dora": (lambda a: edit_config(a, use_dora=True), "adapter_unsupported", "use_dora"),
    "int8_weights": (lambda a: edit_weights(a, lambda t: {k: (v * 8).to(torch.int8) for k, v in t.items()}),
                     "adapter_unsupported", "dtype"),
    "rank_pattern_disagrees": (lambda a: edit_config(a, rank_pattern={"q_proj": 2}), "adapter_invalid",
                               "rank_pattern"),
    "lora_pair_on_embed_tokens": (
        lambda a: (edit_config(a, target_modules=["embed_tokens"]), edit_weights(a, lambda t: {
            "base_model.model.model.embed_tokens.lora_A.weight": torch.ones(4, 64),
            "base_model.model.model.embed_tokens.lora_B.weight": torch.ones(512, 4)})),
        "adapter_unsupported", "target_modules"),
    "lora_bias_ignored": (lambda a: edit_weights(a, lambda t: {**t, **{
        k.replace(".weight", ".bias"): torch.ones(v.shape[0]) for k, v in t.items() if ".lora_B." in k}}),
        "adapter_invalid", "lora_bias"),
    "weights_outside_targets": (lambda a: edit_config(a, target_modules=["q_proj"]), "adapter_incompatible",
                                "target_modules"),
    "targets_without_weights": (lambda a: edit_weights(a, first_module_only), "adapter_invalid", "target_modules"),
    "trainable_tokens": (lambda a: edit_config(a, trainable_token_indices=[1, 2]), "adapter_unsupported",
                         "trainable_token_indices"),
    "unknown_field": (lambda a: edit_config(a, use_magic=True), "adapter_unsupported", "use_magic"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_odd_adapters_are_refused_with_422_naming_the_field_and_no_path(
    case: str, adapter: Path, tiny_store: ModelStore
) -> None:
    breakage, code, words = HOSTILE[case]
    breakage(adapter)
    with pytest.raises(AdapterInvalid) as refused:
        validate_adapter(adapter, tiny_store, "tiny-dense")
    assert (refused.value.code, refused.value.http_status) == (code, 422), refused.value.message
    assert words in refused.value.message
    if case not in ("dora", "unknown_field", "trainable_tokens"):  # these name only the field
        assert str(adapter.parent) not in refused.value.message, refused.value.message


@pytest.fixture(scope="module")
def tiny_model(tiny_store: ModelStore):
    from lorafaas.models.reference import load_backbone

    return load_backbone(tiny_store.path("tiny-dense"))[0]


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_the_worker_applies_the_same_rules_as_deploy(case: str, adapter: Path, tiny_model) -> None:
    """What deploy refuses, a worker refuses with the same error before computing anything (a rank-0 module crashed
    the worker with ZeroDivisionError; int8 weights gave garbage)."""
    from lorafaas.models.lora import attach_adapter, detach_adapter, read_host_adapter

    breakage, code, words = HOSTILE[case]
    breakage(adapter)
    with pytest.raises(AdapterInvalid) as refused:
        attach_adapter(tiny_model, read_host_adapter(adapter))
    detach_adapter(tiny_model)
    assert refused.value.code == code and words in refused.value.message, refused.value.message


def test_redos_target_regex_runs_in_linear_time(adapter: Path, tiny_store: ModelStore) -> None:
    """Issue 18 item 1: this pattern took 12.7 s per upload under Python's re (holding the GIL)."""
    edit_config(adapter, target_modules="model\\.layers\\.1\\.(?:.|.|.|.)*!")
    started = time.monotonic()
    with pytest.raises(AdapterIncompatible, match="matches no layer"):
        validate_adapter(adapter, tiny_store, "tiny-dense")
    assert time.monotonic() - started < 2.0  # generous: RE2 answers in microseconds


def test_symlinked_adapter_directory_is_packed_as_files(adapter: Path, tmp_path: Path) -> None:
    """Issue 18 item 7: the Hugging Face cache layout (snapshots/<rev>/<file> -> ../../blobs/<sha>) deploys."""
    from lorafaas.platform.adapter_upload import pack_adapter, unpack_adapter

    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (blobs / name).write_bytes((adapter / name).read_bytes())
        (snapshot / name).symlink_to(Path("../../blobs") / name)
    (tmp_path / "scratch").mkdir()
    unpacked = unpack_adapter(pack_adapter(snapshot), tmp_path / "scratch")
    assert (unpacked / "adapter_model.safetensors").read_bytes() == (adapter / "adapter_model.safetensors").read_bytes()


def test_warm_up_builds_each_backbones_module_table_and_survives_a_broken_one(tmp_path, tiny_dense_dir, caplog,
                                                                              monkeypatch) -> None:
    """The gateway warms the adapter checks before serving (the first upload must not wait for a module table):
    every stored backbone is built once, and one that cannot be built is logged, not fatal."""
    from lorafaas.formats.model_store import ModelStore
    from lorafaas.models import adapter_validation as validate_module

    store = ModelStore(tmp_path / "models")
    store.import_dir("good", tiny_dense_dir)
    store.import_dir("broken", tiny_dense_dir)
    (store.path("broken") / "config.json").write_text("{not json")
    built = []
    real = validate_module.backbone_module_table
    monkeypatch.setattr(validate_module, "backbone_module_table", lambda path: built.append(path.name) or real(path))
    validate_module.warm_up(store)
    assert sorted(built) == sorted(p.name for p in (store.path("good"), store.path("broken")))
    assert "broken" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused_in_every_float_dtype(adapter, tiny_store, dtype, bad) -> None:
    """The finiteness check reads the file's bits (the gateway does not import torch): each float dtype's NaN and
    infinities are found, and a clean adapter of the same dtype passes."""
    path = adapter / "adapter_model.safetensors"
    weights = {name: tensor.to(dtype) for name, tensor in load_file(path).items()}
    save_file(weights, path)
    validate_adapter(adapter, tiny_store, "tiny-dense")
    last = sorted(weights)[-1]
    weights[last].view(-1)[-1] = bad
    save_file(weights, path)
    with pytest.raises(AdapterInvalid, match=rf"tensor {re.escape(last)} contains NaN or infinite"):
        validate_adapter(adapter, tiny_store, "tiny-dense")


def test_float64_weights_beyond_float32_are_refused(adapter, tiny_store) -> None:
    path = adapter / "adapter_model.safetensors"
    weights = {name: tensor.double() for name, tensor in load_file(path).items()}
    weights[sorted(weights)[0]][0, 0] = 1e39
    save_file(weights, path)
    with pytest.raises(AdapterInvalid, match="holds values float32 cannot hold"):
        validate_adapter(adapter, tiny_store, "tiny-dense")


def test_validating_an_adapter_imports_neither_torch_nor_transformers(tiny_adapter_dir, tiny_store) -> None:
    """The gateway validates every upload: the module table is built in a child process and the weights read with
    numpy, so the gateway's process never holds torch (about 250 MB of it and transformers)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from lorafaas.formats.model_store import ModelStore\n"
        "from lorafaas.models.adapter_validation import validate_adapter, warm_up\n"
        "import lorafaas.platform.server\n"
        f"store = ModelStore(Path({str(tiny_store.models_dir)!r}))\n"
        "warm_up(store)\n"
        f"validate_adapter(Path({str(tiny_adapter_dir)!r}), store, 'tiny-dense')\n"
        "print(sorted(m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_an_adapter_is_packed_as_a_plain_tar_and_a_gzipped_one_still_unpacks(adapter: Path, tmp_path: Path) -> None:
    """Float weights barely compress, and gzip cost a fleet's deploy most of its time (25 s for a 74 MB adapter):
    the CLI sends a plain tar; the platform still reads a gzipped one (older CLIs, curl users)."""
    import io
    import tarfile

    from lorafaas.platform.adapter_upload import pack_adapter, unpack_adapter

    archive = pack_adapter(adapter)
    assert not archive.startswith(b"\x1f\x8b")  # gzip's magic
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:") as tar:
        assert sorted(tar.getnames()) == ["adapter_config.json", "adapter_model.safetensors"]
    gzipped = io.BytesIO()
    with tarfile.open(fileobj=gzipped, mode="w:gz") as tar:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            tar.add(adapter / name, arcname=name)
    for index, packed in enumerate((archive, gzipped.getvalue())):
        (tmp_path / f"scratch-{index}").mkdir()
        unpacked = unpack_adapter(packed, tmp_path / f"scratch-{index}")
        assert (unpacked / "adapter_model.safetensors").read_bytes() == \
            (adapter / "adapter_model.safetensors").read_bytes()
