"""The `helm` that scripts/k8s-testenv.sh puts on the PATH when no binary is installed (tests/support/helm_cli.py):
values files merge as Helm merges them, `--set` types its values as YAML, and bad input is a message and exit 1."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.helm_cli import main, merge, set_value


def test_values_files_merge_maps_key_by_key_and_set_types_values_as_yaml() -> None:
    values = merge({"controller": {"port": 8080, "policy": "lorafaas"}, "nodeAgent": {"backbones": ["a"]}},
                   {"controller": {"port": 9000}, "nodeAgent": {"backbones": ["b"]}})
    set_value(values, "redis.enabled=false")
    set_value(values, "function.resources.limits.cpu='2'")
    set_value(values, "image.tag=")
    assert values == {"controller": {"port": 9000, "policy": "lorafaas"}, "nodeAgent": {"backbones": ["b"]},
                      "redis": {"enabled": False}, "function": {"resources": {"limits": {"cpu": "2"}}},
                      "image": {"tag": ""}}


@pytest.mark.parametrize("argv, message", [
    (["install", "lorafaas", "manifests/charts/lorafaas", "--set", "no-equals-sign"], "expected key.path=value"),
    (["install", "lorafaas", "manifests/charts/lorafaas", "-f", "/nonexistent/values.yaml"], "No such file"),
    (["install", "lorafaas", "/nonexistent/chart"], "/nonexistent/chart"),
])
def test_bad_input_is_a_message_and_exit_1(argv: list[str], message: str, capsys: pytest.CaptureFixture,
                                            monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    assert main(argv) == 1
    assert message in capsys.readouterr().err
