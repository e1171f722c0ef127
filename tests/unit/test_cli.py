"""The command line as a user runs it: real processes, exit codes, JSON on stdout, messages on stderr."""

import json
import shutil
from pathlib import Path

import pytest
import typer

from lorafaas.cli import app, main
from lorafaas.formats.adapter_files import read_adapter


def test_import_from_dir_then_list(tmp_path: Path, tiny_dense_dir: Path, cli) -> None:
    home = str(tmp_path / "home")
    first = cli("--home", home, "backbone", "import", "tiny", "--from", str(tiny_dense_dir))
    assert first.returncode == 0, first.stderr
    assert "imported tiny" in first.stderr
    again = cli("--home", home, "backbone", "import", "tiny", "--from", str(tiny_dense_dir))
    assert again.returncode == 0
    assert "already imported tiny" in again.stderr
    listed = cli("--home", home, "backbone", "list", "--json")
    [entry] = json.loads(listed.stdout)
    assert entry["name"] == "tiny"
    assert entry["architecture"] == "LlamaForCausalLM"
    assert entry["num_parameters"] > 0
    assert len(entry["weights_sha256"]) == 64
    table = cli("--home", home, "backbone", "list")
    assert "tiny" in table.stdout and "LlamaForCausalLM" in table.stdout


def test_home_from_environment(tmp_path: Path, tiny_dense_dir: Path, cli) -> None:
    home = tmp_path / "envhome"
    result = cli("backbone", "import", "tiny", "--from", str(tiny_dense_dir), env={"LORAFAAS_HOME": str(home)})
    assert result.returncode == 0, result.stderr
    assert (home / "models" / "tiny" / "lorafaas.json").is_file()


def test_pickled_source_is_refused_with_exit_2(tmp_path: Path, tiny_dense_dir: Path, cli) -> None:
    src = Path(shutil.copytree(tiny_dense_dir, tmp_path / "src"))
    (src / "model.safetensors").rename(src / "pytorch_model.bin")
    result = cli("--home", str(tmp_path / "home"), "backbone", "import", "x", "--from", str(src))
    assert result.returncode == 2
    assert "pickled weights" in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_builtin_backbone_is_refused(tmp_path: Path, cli) -> None:
    result = cli("--home", str(tmp_path), "backbone", "import", "gpt-17")
    assert result.returncode == 2
    assert "not a built-in backbone" in result.stderr and "smollm2-135m" in result.stderr


@pytest.mark.parametrize("flags", [("--no-shared-base", "--shared-base-from", "4"),
                                   ("--no-step-gate", "--shared-base-from", "4"),
                                   ("--shared-base", "--no-step-gate", "--shared-base-from", "4")])
def test_a_shared_base_threshold_that_would_do_nothing_is_refused(tmp_path: Path, cli, flags) -> None:
    result = cli("--home", str(tmp_path), "up", "--port", "1", *flags)
    assert result.returncode == 2
    message = " ".join(result.stderr.split())
    assert "--shared-base-from" in message and "needs the shared base pass and the step gate" in message, message


def test_empty_store_lists_nothing(tmp_path: Path, cli) -> None:
    result = cli("--home", str(tmp_path), "backbone", "list", "--json")
    assert result.returncode == 0
    assert json.loads(result.stdout) == []


def test_train_inspect_validate_roundtrip(tmp_path: Path, tiny_store, cli) -> None:
    data = tmp_path / "data.jsonl"
    rows = [{"prompt": f"Say {w}.", "response": f"{w} {w} {w}."} for w in ("fox", "dog", "sea", "moon")]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    home = str(tiny_store.models_dir.parent)
    out = tmp_path / "echo"
    trained = cli("--home", home, "adapter", "train", "echo", "--backbone", "tiny-dense", "--data", str(data),
                  "--rank", "2", "--steps", "30", "--lr", "0.01", "--out", str(out))
    assert trained.returncode == 0, trained.stderr
    record = json.loads((out / "lorafaas-train.json").read_text())
    assert record["final_loss"] < record["first_loss"]  # it really trained
    inspected = json.loads(cli("adapter", "inspect", str(out), "--json").stdout)
    assert inspected["rank"] == 2 and inspected["base_model"] == "tiny-dense"
    assert inspected["target_modules"] and inspected["bytes"] == read_adapter(out).num_bytes
    validated = cli("--home", home, "adapter", "validate", str(out), "--backbone", "tiny-dense")
    assert validated.returncode == 0, validated.stderr


def test_train_rejects_malformed_data_with_line_number(tmp_path: Path, tiny_store, cli) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "hi", "response": "ho"}\n{"prompt": 3}\n')
    result = cli("--home", str(tiny_store.models_dir.parent), "adapter", "train", "bad", "--backbone", "tiny-dense",
                 "--data", str(data), "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert f"{data.name}:2: expected" in result.stderr.replace("\n", "")
    assert not (tmp_path / "out").exists()


def _command_paths(cmd, path=()) -> list[tuple[str, ...]]:
    subcommands = getattr(cmd, "commands", {}).items()
    return [path, *(p for name, sub in subcommands for p in _command_paths(sub, (*path, name)))]


def test_every_help_shows_boolean_options_as_bare_flags(capsys) -> None:
    paths = _command_paths(typer.main.get_command(app))
    assert ("invoke",) in paths and ("bench", "coldstart") in paths and ("keys", "create") in paths
    for path in paths:
        with pytest.raises(SystemExit) as exited:
            main([*path, "--help"])
        assert exited.value.code == 0
        shown = capsys.readouterr().out
        assert "--help" in shown and "<bool>" not in shown, (path, shown)


def test_adapter_inspect_shows_rslora_and_the_effective_scaling(tmp_path: Path, tiny_adapter_dir: Path, cli) -> None:
    adapter = Path(shutil.copytree(tiny_adapter_dir, tmp_path / "rslora"))
    config = json.loads((adapter / "adapter_config.json").read_text())
    rank = config["r"]
    config |= {"use_rslora": True, "lora_alpha": 8, "alpha_pattern": {"v_proj": 2}}
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    shown = json.loads(cli("adapter", "inspect", str(adapter), "--json").stdout)
    assert shown["use_rslora"] is True
    assert shown["scaling"] == pytest.approx(8 / rank**0.5)  # rsLoRA: alpha / sqrt(r), not alpha / r
    overrides = shown["scaling_overrides"]
    assert overrides and all(m.endswith("v_proj") for m in overrides)
    assert all(v == pytest.approx(2 / rank**0.5) for v in overrides.values())
    table = cli("adapter", "inspect", str(adapter)).stdout
    assert "use_rslora" in table and f"{8 / rank**0.5:g}" in table


def test_the_remaining_writers_print_json(tmp_path: Path, tiny_dense_dir: Path, tiny_store, cli) -> None:
    home = str(tmp_path / "home")
    imported = json.loads(cli("--home", home, "backbone", "import", "tiny", "--from", str(tiny_dense_dir),
                              "--json").stdout)
    assert imported["name"] == "tiny" and imported["created"] is True and Path(imported["path"]).is_dir()
    again = json.loads(cli("--home", home, "backbone", "import", "tiny", "--from", str(tiny_dense_dir),
                           "--json").stdout)
    assert again["created"] is False and again["weights_sha256"] == imported["weights_sha256"]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {w}.", "response": w}) + "\n" for w in ("a", "b")))
    trained = json.loads(cli("--home", home, "adapter", "train", "echo", "--backbone", "tiny", "--data", str(data),
                             "--rank", "2", "--steps", "2", "--out", str(tmp_path / "echo"), "--json").stdout)
    assert trained["rank"] == 2 and trained["final_loss"] > 0 and trained["path"] == str(tmp_path / "echo")
    moe_home = str(tiny_store.models_dir.parent)
    experts = json.loads(cli("--home", moe_home, "moe", "create-adapter", str(tmp_path / "experts"), "--backbone",
                             "tiny-moe", "--rank", "2", "--json").stdout)
    assert experts["rank"] == 2 and experts["path"] == str(tmp_path / "experts")
