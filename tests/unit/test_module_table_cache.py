"""The gateway's module table of a backbone is built in a child process (seconds: torch and transformers) once per
config: kept on disk, a platform's restart or another home on the same backbone does not start the child again."""

from __future__ import annotations

import subprocess

import pytest

from lorafaas.models import module_table_process
from lorafaas.models.module_table_process import module_table_of


def test_a_table_built_once_is_read_from_the_cache_without_a_child(tiny_dense_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    module_table_process._built.cache_clear()
    first = module_table_of(tiny_dense_dir)
    assert list((tmp_path / "cache" / "lorafaas" / "module-tables").glob("*.json"))
    module_table_process._built.cache_clear()  # as a new gateway process

    def no_child(*args, **kwargs):
        raise AssertionError("the child process was started again")

    monkeypatch.setattr(subprocess, "run", no_child)
    assert module_table_of(tiny_dense_dir) == first


def test_a_damaged_cache_entry_is_built_again(tiny_dense_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    module_table_process._built.cache_clear()
    first = module_table_of(tiny_dense_dir)
    [entry] = (tmp_path / "cache" / "lorafaas" / "module-tables").glob("*.json")
    entry.write_text("{not json")
    module_table_process._built.cache_clear()
    assert module_table_of(tiny_dense_dir) == first
    assert entry.read_bytes().startswith(b"{\"modules\"")
    module_table_process._built.cache_clear()


@pytest.fixture(autouse=True)
def _fresh_memory_cache():
    yield
    module_table_process._built.cache_clear()
