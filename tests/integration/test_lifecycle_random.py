"""A seeded random interleaving of deploy, update (adapter and settings), scale, delete and redeploy under the same
name by two tenants, while streaming and asynchronous invocations run against every name. Bounded in operations and
time. Checked: every completed answer is the answer of an adapter that was current for that name and that tenant
while the request was under way (never another tenant's, never a deleted deployment's); after each operation, no
instance of a deleted function or of a superseded version is left once drained; nothing is left behind after the
platform stops; every accepted asynchronous invocation ends."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from lorafaas.cuda_ipc.shm import list_segments
from lorafaas.errors import FunctionNotFound
from lorafaas.formats.model_store import ModelStore
from lorafaas.platform.api_client import ApiClient
from lorafaas.protocols.daemon_config import DaemonConfig
from lorafaas.testing.platform_process import PlatformProcess, processes_naming, stream_invocation
from lorafaas.testing.tiny_models import save_tiny_adapter

NAMES = ("f1", "f2", "f3")
ADAPTERS = ("alpha", "beta", "gamma", "delta")
NUM_OPERATIONS = 24
# The fleet variant: this many functions deployed first (one batch per tenant), then operations on random ones for at
# most FLEET_OPERATIONS_S (each new instance starts from the pool of pre-forked processes or is forked)
FLEET_FUNCTIONS = 200
FLEET_OPERATIONS = 60
FLEET_OPERATIONS_S = 30.0
LOAD_TASKS = 4
SEED = 20261123
REQUEST = {"messages": [{"role": "user", "content": "Tell me about the ocean."}], "max_tokens": 8}
OK_FAILURES = {"function_not_found", "instance_unavailable"}  # deleted, or updated while it waited (retryable)


@dataclass(frozen=True)
class Operation:
    start_s: float
    end_s: float
    name: str
    after: tuple[str, str] | None  # (tenant, adapter) current once it ended; None: deleted


@dataclass
class Call:
    tenant: str
    name: str
    sent_s: float
    done_s: float = 0.0
    status: int = 0
    code: str | None = None
    text: str | None = None
    mode: str = "stream"


class History:
    def __init__(self) -> None:
        self.operations: list[Operation] = []
        self.lock = threading.Lock()

    def record(self, operation: Operation) -> None:
        with self.lock:
            self.operations.append(operation)

    def allowed(self, name: str, tenant: str, sent_s: float, done_s: float) -> set[str]:
        """Adapters that were the current one of `name` for `tenant` at some moment of [sent_s, done_s]."""
        with self.lock:
            ops = [o for o in self.operations if o.name == name]
        before = [o for o in ops if o.end_s <= sent_s]
        states = {before[-1].after if before else None}
        states |= {o.after for o in ops if o.start_s <= done_s and o.end_s >= sent_s}
        return {adapter for state in states if state is not None for owner, adapter in [state] if owner == tenant}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_dense_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("random-adapters")
    return {name: save_tiny_adapter(root / name, tiny_dense_dir, seed=seed, base_model_name="tiny-dense")
            for seed, name in enumerate(ADAPTERS, start=1)}


@pytest.mark.parametrize("fleet", [False, True], ids=["three-names", "fleet-200"])
def test_random_lifecycle_operations_under_load_never_mix_up_functions(tmp_path, tiny_dense_dir, adapters,
                                                                      fleet) -> None:
    ModelStore(tmp_path / "models").import_dir("tiny-dense", tiny_dense_dir)
    rng = random.Random(SEED)
    names = tuple(f"g{k:03d}" for k in range(FLEET_FUNCTIONS)) if fleet else NAMES
    num_operations, operations_s = (FLEET_OPERATIONS, FLEET_OPERATIONS_S) if fleet else (NUM_OPERATIONS, 600.0)
    history = History()
    calls: list[Call] = []
    with PlatformProcess(tmp_path) as platform, platform.client() as admin:
        keys = {"team-a": admin.create_key("team-a")["key"], "team-b": admin.create_key("team-b")["key"]}
        expected = {}
        for adapter in ADAPTERS:
            admin.deploy({"name": "reference", "backbone": "tiny-dense"}, adapters[adapter])
            expected[admin.invoke("reference", REQUEST)["text"]] = adapter
            admin.delete("reference")
        assert len(expected) == len(ADAPTERS), "every adapter answers differently"
        answer_of = {adapter: text for text, adapter in expected.items()}
        owners: dict[str, tuple[str, str] | None] = dict.fromkeys(names)
        clients = {tenant: ApiClient(platform.url, key) for tenant, key in keys.items()}
        stop = threading.Event()
        failures: list[str] = []
        if fleet:  # every name deployed first, half by each tenant, in one batch each
            archives = {adapter: ApiClient.pack(path) for adapter, path in adapters.items()}
            for k, tenant in enumerate(sorted(keys)):
                mine = names[k::2]
                chosen = [rng.choice(ADAPTERS) for _ in mine]
                started = time.monotonic()
                clients[tenant].deploy_many([{"name": name, "backbone": "tiny-dense", "keep_alive_s": 2}
                                             for name in mine], [archives[a] for a in chosen])
                for name, adapter in zip(mine, chosen, strict=True):
                    owners[name] = (tenant, adapter)
                    history.record(Operation(started, time.monotonic(), name, (tenant, adapter)))

        def operate() -> None:
            deadline = time.monotonic() + operations_s
            try:
                for _ in range(num_operations):
                    if time.monotonic() > deadline:
                        break
                    name = operate_once()
                    check_drained((name,) if fleet else names)
            except Exception as exc:  # reported by the main thread
                failures.append(f"operation failed: {exc!r}")
            finally:
                stop.set()

        def operate_once() -> str:
            name = rng.choice(names)
            state = owners[name]
            adapter = rng.choice(ADAPTERS)
            started = time.monotonic()
            if state is None:
                tenant = rng.choice(sorted(keys))
                clients[tenant].deploy({"name": name, "backbone": "tiny-dense", "max_instances": rng.choice([1, 2]),
                                        "keep_alive_s": rng.choice([0.5, 30])}, adapters[adapter])
                after = (tenant, adapter)
            else:
                tenant, _ = state
                kind = rng.choice(["replace", "settings", "scale", "delete", "redeploy"])
                client = clients[tenant]
                if kind == "replace":
                    client.update(name, {}, adapters[adapter])
                    after = (tenant, adapter)
                elif kind in ("settings", "scale"):
                    change = ({"keep_alive_s": rng.choice([0.5, 5, 30])} if kind == "settings"
                              else {"min_instances": 0, "max_instances": rng.choice([1, 2])})
                    client.update(name, change)
                    after = state
                elif kind == "delete":
                    client.delete(name)
                    after = None
                else:  # delete and deploy the name again, maybe as the other tenant
                    client.delete(name)
                    history.record(Operation(started, time.monotonic(), name, None))
                    tenant = rng.choice(sorted(keys))
                    started = time.monotonic()
                    clients[tenant].deploy({"name": name, "backbone": "tiny-dense"}, adapters[adapter])
                    after = (tenant, adapter)
            owners[name] = after
            history.record(Operation(started, time.monotonic(), name, after))
            return name

        def check_drained(checked: tuple[str, ...]) -> None:
            """No instance of a deleted function, or of another version than the current one, once drained."""
            deadline = time.monotonic() + 30
            while True:
                stale = []
                for name in checked:
                    state = owners[name]
                    try:
                        described = admin.describe(name)
                    except FunctionNotFound:
                        assert state is None
                        stale += instance_lines(platform, name)
                        continue
                    version = described["function"]["version"]
                    stale += [i for i in described["instances"] if i["version"] != version]
                if not stale:
                    return
                assert time.monotonic() < deadline, f"stale instances not drained within 30 s: {stale}"
                time.sleep(0.2)

        async def load(task: int) -> None:
            local = random.Random(SEED + task)
            async with httpx.AsyncClient(base_url=platform.url, timeout=120) as http:
                while not stop.is_set():
                    tenant = local.choice(sorted(keys))
                    call = Call(tenant, local.choice(names), time.monotonic(),
                                mode=local.choice(["stream", "stream", "async"]))
                    headers = {"Authorization": f"Bearer {keys[tenant]}"}
                    if call.mode == "stream":
                        await stream_call(http, headers, call)
                    else:
                        await async_call(http, headers, call)
                    call.done_s = time.monotonic()
                    calls.append(call)

        async def drive() -> None:
            worker = threading.Thread(target=operate)
            worker.start()
            await asyncio.wait_for(asyncio.gather(*(load(k) for k in range(LOAD_TASKS))), 600)
            worker.join(60)

        try:
            asyncio.run(drive())
        finally:
            for client in clients.values():
                client.__exit__(None, None, None)
        assert not failures, failures
    # the fleet's calls mostly start an instance (a pool process, or a fork) and its operations are capped in time
    assert len(calls) >= (10 if fleet else 40), f"the load made only {len(calls)} calls"
    answered = [c for c in calls if c.status == 200 and c.code is None]
    assert answered, "some calls were answered"
    for call in calls:
        assert call.status in (200, 202, 404, 503), (call, "a 5xx other than 503 is a bug")
        if call.code is not None:
            assert call.code in OK_FAILURES, call
    for call in answered:
        allowed = history.allowed(call.name, call.tenant, call.sent_s, call.done_s)
        adapter = expected.get(call.text)
        assert adapter is not None, f"{call}: an answer no adapter gives"
        assert adapter in allowed, (f"{call} was answered by {adapter}; current for {call.tenant} meanwhile: "
                                    f"{sorted(allowed)} ({answer_of})")
    # nothing left behind once the platform stopped
    prefix = DaemonConfig(home=tmp_path, backbone="tiny-dense", device="cpu").paths.segment_prefix
    assert list_segments(prefix) == [], "no shared segment left"
    assert not list((tmp_path / "run").glob("*.sock")), "no socket left"
    assert processes_naming(tmp_path) == {}, "no process left"


def instance_lines(platform: PlatformProcess, name: str) -> list[str]:
    text = httpx.get(f"{platform.url}/metrics", headers={"Authorization": f"Bearer {platform.admin_key}"}).text
    prefix = f'lorafaas_instances{{function="{name}",'
    return [line for line in text.splitlines() if line.startswith(prefix) and not line.endswith(" 0.0")]


async def stream_call(http: httpx.AsyncClient, headers: dict, call: Call) -> None:
    result = await stream_invocation(http, call.name, REQUEST, headers)
    call.status, call.text = result["status"], result["text"]
    call.code = result["error"]["code"] if result["error"] else None


async def async_call(http: httpx.AsyncClient, headers: dict, call: Call) -> None:
    reply = await http.post(f"/v1/functions/{call.name}/invoke", json=REQUEST,
                            headers={**headers, "Prefer": "respond-async"})
    call.status = reply.status_code
    if reply.status_code != 202:
        call.code = reply.json()["error"]["code"]
        return
    location = reply.headers["Location"]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        record = (await http.get(location, headers=headers)).json()
        if record["status"] in ("succeeded", "failed", "cancelled"):
            call.status = 200
            call.code = record.get("error_code")
            call.text = record.get("result_text")
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"async invocation {location} did not end within 120 s")
