"""`lorafaas up` takes the admin key from LORAFAAS_ADMIN_KEY, or from the file LORAFAAS_ADMIN_KEY_FILE names (the chart
mounts its Secret as a file rather than exposing it in the environment)."""

from pathlib import Path

import pytest

from lorafaas.cli.up import _admin_key_from_env
from lorafaas.errors import InvalidInput


def test_the_admin_key_comes_from_the_environment_or_a_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("LORAFAAS_ADMIN_KEY", raising=False)
    monkeypatch.delenv("LORAFAAS_ADMIN_KEY_FILE", raising=False)
    assert _admin_key_from_env() is None
    (tmp_path / "admin-key").write_text("k" * 32 + "\n")
    monkeypatch.setenv("LORAFAAS_ADMIN_KEY_FILE", str(tmp_path / "admin-key"))
    assert _admin_key_from_env() == "k" * 32
    monkeypatch.setenv("LORAFAAS_ADMIN_KEY", "e" * 32)  # the variable wins
    assert _admin_key_from_env() == "e" * 32
    monkeypatch.delenv("LORAFAAS_ADMIN_KEY")
    monkeypatch.setenv("LORAFAAS_ADMIN_KEY_FILE", str(tmp_path / "missing"))
    with pytest.raises(InvalidInput, match="LORAFAAS_ADMIN_KEY_FILE"):
        _admin_key_from_env()
