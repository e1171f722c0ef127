"""A batch deploy's cost per function does not grow with the functions already deployed: the tenant's adapters are
read once per batch, and a deploy that stored its function collects nothing (a collect lists every function and every
adapter). A real SQLite store, counting the listings it serves; a real adapter store and model store."""

from __future__ import annotations

import asyncio
import io
import time
from pathlib import Path

from lorafaas.formats.model_store import ModelStore
from lorafaas.platform.adapter_store import AdapterStore
from lorafaas.platform.adapter_upload import pack_adapter
from lorafaas.platform.agent import AgentConfig, NodeAgent
from lorafaas.platform.batch_deploy import BatchEntry, deploy_batch
from lorafaas.platform.service import FunctionService
from lorafaas.platform.state.records import ApiKeyRecord, FunctionSpec
from lorafaas.platform.state.sqlite import SQLiteStore
from lorafaas.scheduler import SchedulerConfig
from lorafaas.testing.synthetic_adapters import write_random_adapter
from tests.support.store_only_launcher import StoreOnlyLauncher


class CountingStore(SQLiteStore):
    """The real store, counting `list_functions` calls (each reads and decodes every function's record)."""

    num_listings = 0

    def list_functions(self, tenant: str | None = None) -> list[FunctionSpec]:
        self.num_listings += 1
        return super().list_functions(tenant)



def test_a_batch_lists_the_functions_once_however_many_it_deploys(tmp_path: Path, tiny_store: ModelStore) -> None:
    store = CountingStore(tmp_path / "state.db")
    adapters = AdapterStore(tmp_path / "adapters")
    agent = NodeAgent(StoreOnlyLauncher(tiny_store), adapters.path,  # type: ignore[arg-type]
                      AgentConfig(scheduler=SchedulerConfig(preloading=False)))
    service = FunctionService(store, tiny_store, adapters, agent)
    now = time.time()
    for index in range(50):  # already deployed: none of these is read again per function of the batch
        store.put_function(FunctionSpec(name=f"old-{index}", tenant="acme", backbone="tiny-dense",
                                        adapter_digest=f"{index:064x}", created_at=now, updated_at=now), create=True)
    archives = [pack_adapter(write_random_adapter(tmp_path / f"a{i}", tiny_store, "tiny-dense", rank=4,
                                                  target_modules=("q_proj",), seed=i)) for i in range(8)]
    entries = [BatchEntry(name=f"new-{i}", fields={"name": f"new-{i}", "backbone": "tiny-dense"}) for i in range(8)]
    admin = ApiKeyRecord(key_id="k", key_hash="0" * 64, tenant="acme", is_admin=True, created_at=now)
    async def deploy() -> None:
        result = await deploy_batch(service, admin, entries, [io.BytesIO(a) for a in archives])
        assert [spec.name for spec in result.deployed] == [f"new-{i}" for i in range(8)] and not result.refused
        await agent.stop()

    store.num_listings = 0
    asyncio.run(deploy())
    assert store.num_listings == 1, store.num_listings  # the tenant's adapters, once for the whole batch
    assert len(store.list_functions()) == 58
