"""One behaviour suite for both state stores (SQLite file, real Redis server), plus what only one of them does."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest

from lorafaas.errors import (
    AlreadyExists,
    ApiKeyNotFound,
    FunctionNotFound,
    InvalidInput,
    InvalidName,
    InvocationNotFound,
    StoreUnavailable,
)
from lorafaas.platform.state.interface import StateStore, open_store, sqlite_url
from lorafaas.platform.state.records import (
    ApiKeyRecord,
    ChatMessage,
    FunctionSpec,
    InvocationRecord,
    InvocationRequest,
    UsageRecord,
)
from lorafaas.platform.state.redis_store import RedisStore, redact_url
from lorafaas.platform.state.sqlite import SQLiteStore

DIGEST_A = "a" * 64
DIGEST_B = "b" * 64

OpenStore = Callable[[], StateStore]


def spec(name: str = "fn-a", tenant: str = "acme", **changes: object) -> FunctionSpec:
    fields = {"backbone": "tiny-dense", "adapter_digest": DIGEST_A, "created_at": 100.0, "updated_at": 100.0}
    return FunctionSpec(name=name, tenant=tenant, **{**fields, **changes})


def invocation(invocation_id: str, status: str = "queued", *, created_at: float = 1.0, expires_at: float = 1e9,
               **changes: object) -> InvocationRecord:
    return InvocationRecord(
        invocation_id=invocation_id, function="fn-a", tenant="acme", status=status,
        request=InvocationRequest(prompt="hi", max_tokens=8, stop=["\n"], seed=3),
        created_at=created_at, updated_at=created_at, expires_at=expires_at, **changes,
    )


def key(key_id: str, tenant: str = "acme", key_hash: str | None = None, is_admin: bool = False) -> ApiKeyRecord:
    return ApiKeyRecord(key_id=key_id, tenant=tenant, key_hash=key_hash or f"hash-{key_id}", is_admin=is_admin,
                        created_at=5.0)


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def open_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OpenStore]:
    """Opens a new store (a new connection or client) on the same backend, each closed at teardown."""
    url = sqlite_url(tmp_path) if request.param == "sqlite" else request.getfixturevalue("redis_url")
    opened: list[StateStore] = []

    def open_new() -> StateStore:
        opened.append(open_store(url))
        return opened[-1]

    yield open_new
    for store in opened:
        store.close()


@pytest.fixture
def store(open_backend: OpenStore) -> StateStore:
    return open_backend()


# The shared suite


def test_store_satisfies_the_protocol(store: StateStore) -> None:
    assert isinstance(store, StateStore)
    store.ping()


def test_function_create_read_update_delete(store: StateStore) -> None:
    created = spec()
    store.put_function(created, create=True)
    assert store.get_function("fn-a") == created
    updated = msgspec.structs.replace(created, slo_ttft_ms=250, version=2, updated_at=200.0)
    store.put_function(updated, create=False)
    assert store.get_function("fn-a") == updated
    store.delete_function("fn-a")
    with pytest.raises(FunctionNotFound, match="'fn-a'"):
        store.get_function("fn-a")
    with pytest.raises(FunctionNotFound):
        store.delete_function("fn-a")
    assert store.list_functions() == []


def test_update_of_an_absent_function_is_refused_and_creates_nothing(store: StateStore) -> None:
    with pytest.raises(FunctionNotFound, match="deploy it first"):
        store.put_function(spec(), create=False)
    assert store.list_functions() == []
    assert store.list_functions("acme") == []


def test_duplicate_create_is_refused_and_the_stored_spec_is_unchanged(store: StateStore) -> None:
    first = spec()
    store.put_function(first, create=True)
    with pytest.raises(AlreadyExists, match="'fn-a' already exists"):
        store.put_function(spec(adapter_digest=DIGEST_B, tenant="other", created_at=300.0), create=True)
    assert store.get_function("fn-a") == first
    assert [f.name for f in store.list_functions("other")] == []


def test_listing_is_sorted_by_name_and_filters_by_tenant(store: StateStore) -> None:
    for name, tenant in [("zeta", "acme"), ("alpha", "beta-co"), ("mid", "acme"), ("beta", "acme")]:
        store.put_function(spec(name, tenant), create=True)
    assert [f.name for f in store.list_functions()] == ["alpha", "beta", "mid", "zeta"]
    assert [f.name for f in store.list_functions("acme")] == ["beta", "mid", "zeta"]
    assert [f.name for f in store.list_functions("beta-co")] == ["alpha"]
    assert store.list_functions("nobody") == []
    # An update that moves a function to another tenant moves it in the tenant listing too.
    store.put_function(spec("mid", "beta-co", version=2), create=False)
    assert [f.name for f in store.list_functions("acme")] == ["beta", "zeta"]
    assert [f.name for f in store.list_functions("beta-co")] == ["alpha", "mid"]
    store.delete_function("zeta")
    assert [f.name for f in store.list_functions("acme")] == ["beta"]


def test_invocation_lifecycle(store: StateStore) -> None:
    queued = invocation("inv-1", "queued")
    store.put_invocation(queued)
    assert store.get_invocation("inv-1") == queued
    assert [r.invocation_id for r in store.list_invocations("queued")] == ["inv-1"]
    running = msgspec.structs.replace(queued, status="running", updated_at=2.0)
    store.put_invocation(running)
    assert store.list_invocations("queued") == []
    assert store.list_invocations("running") == [running]
    done = msgspec.structs.replace(
        running, status="succeeded", result_text="hello", finish_reason="stop", prompt_tokens=3,
        completion_tokens=5, updated_at=3.0,
    )
    store.put_invocation(done)
    assert store.get_invocation("inv-1") == done
    assert store.list_invocations("running") == []
    assert store.list_invocations("succeeded") == [done]
    assert store.get_invocation("inv-1").is_finished
    with pytest.raises(InvocationNotFound, match="'inv-missing'"):
        store.get_invocation("inv-missing")


def test_invocations_list_oldest_first_and_keep_chat_requests(store: StateStore) -> None:
    chat = InvocationRequest(messages=[ChatMessage(role="user", content="hi")], max_tokens=4)
    store.put_invocation(invocation("inv-late", created_at=30.0))
    store.put_invocation(msgspec.structs.replace(invocation("inv-early", created_at=10.0), request=chat))
    store.put_invocation(invocation("inv-mid", "failed", created_at=20.0, error_code="instance_unavailable",
                                    error_message="worker crashed"))
    assert [r.invocation_id for r in store.list_invocations()] == ["inv-early", "inv-mid", "inv-late"]
    assert store.get_invocation("inv-early").request.messages == [ChatMessage(role="user", content="hi")]
    assert store.get_invocation("inv-mid").error_code == "instance_unavailable"


def test_expired_invocations_are_deleted_with_their_indexes(store: StateStore) -> None:
    store.put_invocation(invocation("inv-10", "succeeded", expires_at=10.0))
    store.put_invocation(invocation("inv-20", "failed", expires_at=20.0))
    store.put_invocation(invocation("inv-30", "succeeded", expires_at=30.0))
    assert store.delete_expired_invocations(5.0) == 0
    assert store.delete_expired_invocations(20.0) == 2
    with pytest.raises(InvocationNotFound):
        store.get_invocation("inv-10")
    assert [r.invocation_id for r in store.list_invocations()] == ["inv-30"]
    assert [r.invocation_id for r in store.list_invocations("succeeded")] == ["inv-30"]
    assert store.list_invocations("failed") == []
    assert store.delete_expired_invocations(20.0) == 0
    # A retention deadline moved later by an update is respected.
    store.put_invocation(invocation("inv-30", "succeeded", expires_at=100.0))
    assert store.delete_expired_invocations(50.0) == 0
    assert store.delete_expired_invocations(100.0) == 1


def test_keys_are_found_by_hash_listed_by_tenant_and_deleted(store: StateStore) -> None:
    store.put_key(key("k1", "acme"))
    store.put_key(key("k2", "beta-co"))
    store.put_key(key("k0", "admin", is_admin=True))
    assert store.find_key("hash-k1") == key("k1", "acme")
    assert store.find_key("hash-nope") is None
    assert [k.key_id for k in store.list_keys()] == ["k1", "k0", "k2"]  # by (tenant, key_id)
    assert [k.key_id for k in store.list_keys("acme")] == ["k1"]
    store.delete_key("k1")
    assert store.find_key("hash-k1") is None
    assert [k.key_id for k in store.list_keys("acme")] == []
    with pytest.raises(ApiKeyNotFound, match="'k1'"):
        store.delete_key("k1")


def test_putting_a_key_id_again_replaces_its_hash_and_tenant(store: StateStore) -> None:
    store.put_key(key("k1", "acme", key_hash="old-hash"))
    store.put_key(key("k1", "beta-co", key_hash="new-hash", is_admin=True))
    assert store.find_key("old-hash") is None  # rotated: the old key no longer authenticates
    assert store.find_key("new-hash") == key("k1", "beta-co", key_hash="new-hash", is_admin=True)
    assert store.list_keys("acme") == []
    assert [k.key_id for k in store.list_keys("beta-co")] == ["k1"]


def test_a_hash_belongs_to_one_key_id(store: StateStore) -> None:
    store.put_key(key("k1", key_hash="same"))
    with pytest.raises(AlreadyExists, match="'k2'"):
        store.put_key(key("k2", key_hash="same"))
    assert store.find_key("same").key_id == "k1"
    assert [k.key_id for k in store.list_keys()] == ["k1"]


def test_a_keys_last_use_is_recorded_durably_and_leaves_with_the_key(open_backend: OpenStore) -> None:
    store = open_backend()
    store.put_key(key("k1"))
    store.put_key(key("k2", "beta-co"))
    assert store.find_key("hash-k1").last_used_at is None
    store.touch_key("k1", 1234.5)
    store.touch_key("k1", 1300.25)
    store.touch_key("gone", 1.0)  # a key deleted meanwhile stays deleted
    assert store.find_key("hash-gone") is None and [k.key_id for k in store.list_keys()] == ["k1", "k2"]
    store.close()
    reopened = open_backend()
    assert reopened.find_key("hash-k1").last_used_at == 1300.25
    assert {k.key_id: k.last_used_at for k in reopened.list_keys()} == {"k1": 1300.25, "k2": None}
    reopened.delete_key("k1")
    reopened.put_key(key("k1"))  # the same id issued again starts unused
    assert reopened.find_key("hash-k1").last_used_at is None


def usage(invocation_id: str, tenant: str, finished_at: float, device_s: float = 0.5) -> UsageRecord:
    return UsageRecord(invocation_id=invocation_id, tenant=tenant, function=f"fn-{tenant}", deployment="d1",
                       finished_at=finished_at, prompt_tokens=3, completion_tokens=5, queue_s=0.0, ttft_s=0.1,
                       e2e_s=0.2, cold_start="libraries_preloaded", cold_start_s={"spawn": 0.1}, device_s=device_s,
                       memory_active_gb_s=0.01, memory_idle_gb_s=0.0)


def test_usage_is_listed_by_time_window_and_tenant_oldest_first_and_survives_reopening(
        open_backend: OpenStore) -> None:
    store = open_backend()
    for record in (usage("u3", "acme", 30.0), usage("u1", "acme", 10.0), usage("u2", "globex", 20.0),
                   usage("u4", "globex", 40.0)):
        store.put_usage(record)
    store.put_usage(usage("u4", "globex", 40.0, device_s=0.75))  # written again: replaced, not doubled
    assert [r.invocation_id for r in store.list_usage()] == ["u1", "u2", "u3", "u4"]
    assert [r.invocation_id for r in store.list_usage(since=20.0, until=40.0)] == ["u2", "u3"]  # [since, until)
    assert [r.invocation_id for r in store.list_usage(since=15.0, tenant="acme")] == ["u3"]
    assert [r.invocation_id for r in store.list_usage(until=10.0)] == []
    store.close()
    reopened = open_backend()
    assert reopened.list_usage(tenant="globex") == [usage("u2", "globex", 20.0), usage("u4", "globex", 40.0, 0.75)]


def test_everything_survives_reopening_the_store(open_backend: OpenStore) -> None:
    first = open_backend()
    first.put_function(spec(), create=True)
    first.put_invocation(invocation("inv-1", "running"))
    first.put_key(key("k1"))
    first.close()
    second = open_backend()
    assert second.get_function("fn-a") == spec()
    assert second.list_functions("acme") == [spec()]
    assert second.get_invocation("inv-1") == invocation("inv-1", "running")
    assert second.list_invocations("running") == [invocation("inv-1", "running")]
    assert second.find_key("hash-k1") == key("k1")


def test_concurrent_creates_of_one_name_let_exactly_one_win(open_backend: OpenStore) -> None:
    store = open_backend()
    num_threads = 8
    barrier = threading.Barrier(num_threads)
    outcomes: list[str] = [""] * num_threads

    def deploy(i: int) -> None:
        barrier.wait()
        try:
            store.put_function(spec(tenant=f"tenant-{i}", created_at=float(i)), create=True)
            outcomes[i] = "won"
        except AlreadyExists:
            outcomes[i] = "refused"

    threads = [threading.Thread(target=deploy, args=(i,)) for i in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(outcomes) == ["refused"] * (num_threads - 1) + ["won"]
    winner = outcomes.index("won")
    assert store.get_function("fn-a") == spec(tenant=f"tenant-{winner}", created_at=float(winner))
    # A second client (another gateway replica) sees the same single winner.
    assert [f.tenant for f in open_backend().list_functions()] == [f"tenant-{winner}"]


def test_concurrent_writers_of_distinct_records_lose_nothing(open_backend: OpenStore) -> None:
    stores = [open_backend(), open_backend()]

    def write(worker: int) -> None:
        for i in range(25):
            stores[worker].put_function(spec(f"fn-{worker}-{i}", f"tenant-{worker}"), create=True)
            stores[worker].put_invocation(invocation(f"inv-{worker}-{i}", created_at=float(i)))

    threads = [threading.Thread(target=write, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(stores[0].list_functions()) == 50
    assert len(stores[1].list_functions("tenant-1")) == 25
    assert len(stores[0].list_invocations("queued")) == 50


# SQLite only


def run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout)


def test_sqlite_commit_survives_the_process_being_killed(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    result = run_python(f"""
        import os, signal
        from lorafaas.platform.state.sqlite import SQLiteStore
        from lorafaas.platform.state.records import FunctionSpec
        store = SQLiteStore({str(db)!r})
        store.put_function(FunctionSpec(name="fn-a", tenant="acme", backbone="tiny-dense",
                                        adapter_digest={DIGEST_A!r}, created_at=100.0, updated_at=100.0), create=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no close, no checkpoint, no atexit
    """)
    assert result.returncode == -9, result.stderr
    with SQLiteStore(db) as store:
        assert store.get_function("fn-a") == spec()


def test_sqlite_two_processes_race_for_one_name_and_write_side_by_side(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    SQLiteStore(db).close()
    code = f"""
        import sys, time
        from lorafaas.errors import AlreadyExists
        from lorafaas.platform.state.sqlite import SQLiteStore
        from lorafaas.platform.state.records import FunctionSpec
        worker = int(sys.argv[1])
        store = SQLiteStore({str(db)!r})
        def spec(name, tenant):
            return FunctionSpec(name=name, tenant=tenant, backbone="tiny-dense", adapter_digest={DIGEST_A!r},
                                created_at=1.0, updated_at=1.0)
        while time.time() < {time.time() + 1.0}:  # start together
            pass
        try:
            store.put_function(spec("contested", f"tenant-{{worker}}"), create=True)
            print("won")
        except AlreadyExists:
            print("refused")
        for i in range(30):
            store.put_function(spec(f"fn-{{worker}}-{{i}}", f"tenant-{{worker}}"), create=True)
    """
    procs = [
        subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), str(w)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for w in range(2)
    ]
    outputs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outputs]
    assert sorted(out.strip() for out, _ in outputs) == ["refused", "won"]
    with SQLiteStore(db) as store:
        assert len(store.list_functions()) == 61
        winner = store.get_function("contested").tenant
        assert [out.strip() for out, _ in outputs][int(winner.removeprefix("tenant-"))] == "won"


def test_sqlite_file_is_private_and_in_wal_mode(tmp_path: Path) -> None:
    with SQLiteStore(tmp_path / "home" / "state.db") as store:
        store.put_key(key("k1"))
    db = tmp_path / "home" / "state.db"
    assert db.stat().st_mode & 0o777 == 0o600
    import sqlite3

    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()


def test_sqlite_closed_or_corrupt_store_is_unavailable(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "state.db")
    store.close()
    store.close()  # idempotent
    with pytest.raises(StoreUnavailable, match="is closed"):
        store.ping()
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreUnavailable, match=r"garbage\.db"):
        SQLiteStore(garbage)


# Redis only


@pytest.mark.redis
def test_redis_restart_is_picked_up_by_an_open_client_and_loses_nothing(redis_server) -> None:
    store = RedisStore(redis_server.url())
    try:
        store.put_function(spec(), create=True)
        store.put_invocation(invocation("inv-1", "running"))
        store.put_key(key("k1"))
        redis_server.stop()
        with pytest.raises(StoreUnavailable, match=f"127.0.0.1:{redis_server.port}"):
            store.get_function("fn-a")
        redis_server.start()  # same port, same data directory
        assert store.get_function("fn-a") == spec()  # the very next call works again
        assert store.list_functions("acme") == [spec()]
        assert store.list_invocations("running") == [invocation("inv-1", "running")]
        assert store.find_key("hash-k1") == key("k1")
        with pytest.raises(AlreadyExists):  # the scripts are loaded again on the new server
            store.put_function(spec(), create=True)
        store.put_function(spec("fn-b"), create=True)
        assert [f.name for f in store.list_functions()] == ["fn-a", "fn-b"]
    finally:
        store.close()


@pytest.mark.redis
def test_redis_restart_between_calls_is_invisible(redis_server) -> None:
    store = RedisStore(redis_server.url())
    try:
        store.put_function(spec(), create=True)
        redis_server.restart()  # the pooled connection is now dead; the client reconnects by itself
        store.ping()
        assert store.get_function("fn-a") == spec()
    finally:
        store.close()


def test_unreachable_redis_is_store_unavailable_quickly() -> None:
    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = RedisStore(f"redis://:hunter2@127.0.0.1:{port}/0")
    try:
        started = time.monotonic()
        expected = re.escape(f"cannot reach Redis at redis://:***@127.0.0.1:{port}/0")
        with pytest.raises(StoreUnavailable, match=expected) as err:
            store.ping()
        assert time.monotonic() - started < 3.0
        assert "hunter2" not in err.value.message
        assert err.value.http_status == 503
        with pytest.raises(StoreUnavailable, match="to read function 'fn-a'"):
            store.get_function("fn-a")
    finally:
        store.close()


@pytest.mark.redis
def test_records_keep_the_prefix(redis_url: str) -> None:
    import redis

    store = RedisStore(redis_url)
    try:
        store.put_function(spec(), create=True)
        store.put_key(key("k1"))
        client = redis.Redis.from_url(redis_url)
        assert all(k.startswith(b"lorafaas:") for k in client.keys("*"))
        assert msgspec.json.decode(client.get("lorafaas:function:fn-a"), type=FunctionSpec) == spec()
        client.close()
    finally:
        store.close()


def test_redis_url_password_is_not_shown() -> None:
    assert redact_url("redis://user:s3cret@host:6380/1") == "redis://user:***@host:6380/1"
    assert redact_url("redis://host:6380/0") == "redis://host:6380/0"


# open_store and records


def test_open_store_urls(tmp_path: Path) -> None:
    with open_store(sqlite_url(tmp_path / "home")) as store:
        assert isinstance(store, SQLiteStore)
    assert (tmp_path / "home" / "state.db").is_file()
    assert isinstance(open_store("redis://127.0.0.1:1/0"), RedisStore)  # lazy: nothing is connected yet
    with pytest.raises(InvalidInput, match="absolute file path"):
        open_store("sqlite://relative.db")
    with pytest.raises(InvalidInput, match="'postgres' is not supported"):
        open_store("postgres://db/lorafaas")


def test_function_spec_bounds() -> None:
    assert spec().check() == spec()
    cases = [
        ({"slo_ttft_ms": 0}, "slo_ttft_ms is 0 ms; it must be between 1 and 600000 ms"),
        ({"slo_ttft_ms": 600_001}, "between 1 and 600000"),
        ({"keep_alive_s": -1.0}, "keep_alive_s is -1 s"),
        ({"keep_alive_s": float("nan")}, "keep_alive_s is nan"),
        ({"keep_alive_s": 86_401.0}, "between 0 and 86400 s"),
        ({"max_instances": 0}, "max_instances is 0; it must be between 1 and 64"),
        ({"max_instances": 65}, "max_instances is 65"),
        ({"min_instances": 5, "max_instances": 4}, "min_instances is 5 but max_instances is 4"),
        ({"max_tokens_limit": 0}, "max_tokens_limit is 0"),
        ({"lora_mode": "merged"}, "lora_mode is 'merged'; expected one of local, remote"),
        ({"adapter_digest": "abc"}, "adapter digest 'abc' is invalid"),
        ({"version": 0}, "version is 0"),
        ({"updated_at": 50.0}, "updated_at 50.0 is before created_at 100.0"),
    ]
    for changes, message in cases:
        with pytest.raises(InvalidInput, match=re.escape(message)):
            spec(**changes).check()
    with pytest.raises(InvalidName, match="function name 'Bad_Name'"):
        spec("Bad_Name").check()
    with pytest.raises(InvalidName, match="tenant name"):
        spec(tenant="ACME").check()


def test_invocation_request_bounds() -> None:
    assert InvocationRequest(prompt="hi").check() == InvocationRequest(prompt="hi")
    with pytest.raises(InvalidInput, match="exactly one of 'prompt' or 'messages'"):
        InvocationRequest().check()
    with pytest.raises(InvalidInput, match="exactly one"):
        InvocationRequest(prompt="hi", messages=[ChatMessage(role="user", content="hi")]).check()
    with pytest.raises(InvalidInput, match="max_tokens is 2000; it must be between 1 and 1024"):
        InvocationRequest(prompt="hi", max_tokens=2000).check(max_tokens_limit=1024)
    with pytest.raises(InvalidInput, match="top_p is 0"):
        InvocationRequest(prompt="hi", top_p=0.0).check()
    with pytest.raises(InvalidInput, match="temperature is 3"):
        InvocationRequest(prompt="hi", temperature=3.0).check()


def test_records_decode_with_unknown_fields_from_a_newer_writer() -> None:
    data = msgspec.json.encode(spec())[:-1] + b',"future_field":1}'
    assert msgspec.json.decode(data, type=FunctionSpec) == spec()


def test_sqlite_url_is_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert sqlite_url(Path("rel")) == "sqlite://" + str(tmp_path.resolve() / "rel" / "state.db")
