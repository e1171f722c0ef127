"""Both state stores at a thousand functions: every one listed, in name order, a tenant's alone, one read each (the
Redis store reads the records with one MGET, not a round trip per record)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lorafaas.platform.state.interface import StateStore, open_store, sqlite_url
from lorafaas.platform.state.records import FunctionSpec


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StateStore]:
    url = sqlite_url(tmp_path) if request.param == "sqlite" else request.getfixturevalue("redis_url")
    opened = open_store(url)
    yield opened
    opened.close()


def test_a_thousand_functions_are_all_listed_in_name_order(store: StateStore) -> None:
    now = time.time()
    names = [f"fn-{index:04d}" for index in range(1000)]
    for index, name in enumerate(reversed(names)):
        store.put_function(FunctionSpec(name=name, tenant="acme" if index % 4 else "beta", backbone="tiny-dense",
                                        adapter_digest=f"{index:064x}", created_at=now, updated_at=now), create=True)
    listed = store.list_functions()
    assert [spec.name for spec in listed] == names
    assert len(store.list_functions("beta")) == 250 and len(store.list_functions("acme")) == 750
    assert store.get_function("fn-0999").tenant in ("acme", "beta")
