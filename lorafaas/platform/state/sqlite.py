"""The embedded state store: one SQLite file (`$LORAFAAS_HOME/state.db`) in WAL mode.

One table per record kind holds the record as msgspec JSON plus the columns queries need. Every write is a single
statement, so atomic by itself; a commit is on disk when it returns (synchronous=FULL), so a killed process loses
nothing it was told was stored. Threads share one connection behind a lock; other processes open their own and
SQLite's file locks order them (a writer waits up to `busy_timeout_s` for another).
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import msgspec

from lorafaas.errors import (
    AlreadyExists,
    ApiKeyNotFound,
    FunctionNotFound,
    InvocationNotFound,
    ServerError,
    StoreUnavailable,
)
from lorafaas.platform.state.records import ApiKeyRecord, FunctionSpec, InvocationRecord, UsageRecord

SCHEMA_VERSION = 1
SCHEMA = """
CREATE TABLE IF NOT EXISTS functions (
    name TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS functions_tenant ON functions (tenant);
CREATE TABLE IF NOT EXISTS invocations (
    invocation_id TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS invocations_status ON invocations (status, created_at);
CREATE INDEX IF NOT EXISTS invocations_expires ON invocations (expires_at);
CREATE INDEX IF NOT EXISTS invocations_created ON invocations (created_at, invocation_id);
CREATE TABLE IF NOT EXISTS api_keys (
    key_id TEXT PRIMARY KEY,
    key_hash TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS api_keys_tenant ON api_keys (tenant, key_id);
CREATE TABLE IF NOT EXISTS usage (
    invocation_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    finished_at REAL NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS usage_finished ON usage (finished_at, invocation_id);
CREATE INDEX IF NOT EXISTS usage_tenant ON usage (tenant, finished_at, invocation_id);
"""

R = TypeVar("R")


class SQLiteStore:
    def __init__(self, path: Path, *, busy_timeout_s: float = 10.0) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = self._connect(busy_timeout_s)

    def __repr__(self) -> str:
        return f"SQLiteStore({str(self.path)!r})"

    def __enter__(self) -> SQLiteStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _connect(self, busy_timeout_s: float) -> sqlite3.Connection:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # The file holds key hashes: owner-only. SQLite gives its -wal and -shm files the same mode.
            os.close(os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600))
            conn = sqlite3.connect(
                self.path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
            )
        except (OSError, sqlite3.Error) as exc:
            raise StoreUnavailable(f"cannot open the state store {self.path}: {exc}") from exc
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("BEGIN IMMEDIATE")
            found = conn.execute("PRAGMA user_version").fetchone()[0]
            if found > SCHEMA_VERSION:
                conn.execute("ROLLBACK")
                raise ServerError(
                    f"state store {self.path} has schema version {found}; this lorafaas reads up to "
                    f"{SCHEMA_VERSION}: upgrade lorafaas or use another LORAFAAS_HOME"
                )
            for statement in SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            conn.close()
            raise StoreUnavailable(f"cannot open the state store {self.path}: {exc}") from exc
        except ServerError:
            conn.close()
            raise
        return conn

    @contextmanager
    def _connection(self, action: str) -> Iterator[sqlite3.Connection]:
        """The one connection, held under the lock; SQLite failures become StoreUnavailable."""
        with self._lock:
            if self._conn is None:
                raise StoreUnavailable(f"state store {self.path} is closed; cannot {action}")
            try:
                yield self._conn
            except sqlite3.IntegrityError:
                raise  # a constraint the caller translates (duplicate name or key)
            except sqlite3.Error as exc:
                raise StoreUnavailable(f"state store {self.path}: cannot {action}: {exc}") from exc

    def _decode(self, data: str, kind: type[R], key: str) -> R:
        try:
            return msgspec.json.decode(data, type=kind)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ServerError(
                f"state store {self.path}: the stored {kind.__name__} {key!r} is unreadable: {exc}"
            ) from exc

    # Functions

    def put_function(self, spec: FunctionSpec, *, create: bool) -> None:
        data = msgspec.json.encode(spec).decode()
        with self._connection(f"store function {spec.name!r}") as conn:
            if create:
                try:
                    conn.execute(
                        "INSERT INTO functions (name, tenant, data) VALUES (?, ?, ?)", (spec.name, spec.tenant, data)
                    )
                except sqlite3.IntegrityError as exc:
                    raise AlreadyExists(f"function {spec.name!r} already exists; update or delete it first") from exc
                return
            cursor = conn.execute(
                "UPDATE functions SET tenant = ?, data = ? WHERE name = ?", (spec.tenant, data, spec.name)
            )
        if cursor.rowcount == 0:
            raise FunctionNotFound(f"function {spec.name!r} does not exist; deploy it first")

    def get_function(self, name: str) -> FunctionSpec:
        with self._connection(f"read function {name!r}") as conn:
            row = conn.execute("SELECT data FROM functions WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise FunctionNotFound(f"function {name!r} does not exist")
        return self._decode(row[0], FunctionSpec, name)

    def list_functions(self, tenant: str | None = None) -> list[FunctionSpec]:
        with self._connection("list functions") as conn:
            if tenant is None:
                rows = conn.execute("SELECT name, data FROM functions ORDER BY name").fetchall()
            else:
                rows = conn.execute(
                    "SELECT name, data FROM functions WHERE tenant = ? ORDER BY name", (tenant,)
                ).fetchall()
        return [self._decode(data, FunctionSpec, name) for name, data in rows]

    def delete_function(self, name: str) -> None:
        with self._connection(f"delete function {name!r}") as conn:
            cursor = conn.execute("DELETE FROM functions WHERE name = ?", (name,))
        if cursor.rowcount == 0:
            raise FunctionNotFound(f"function {name!r} does not exist")

    # Invocations

    def put_invocation(self, record: InvocationRecord) -> None:
        data = msgspec.json.encode(record).decode()
        with self._connection(f"store invocation {record.invocation_id!r}") as conn:
            conn.execute(
                "INSERT OR REPLACE INTO invocations (invocation_id, status, created_at, expires_at, data) "
                "VALUES (?, ?, ?, ?, ?)",
                (record.invocation_id, record.status, record.created_at, record.expires_at, data),
            )

    def get_invocation(self, invocation_id: str) -> InvocationRecord:
        with self._connection(f"read invocation {invocation_id!r}") as conn:
            row = conn.execute("SELECT data FROM invocations WHERE invocation_id = ?", (invocation_id,)).fetchone()
        if row is None:
            raise InvocationNotFound(f"invocation {invocation_id!r} does not exist (never issued, or expired)")
        return self._decode(row[0], InvocationRecord, invocation_id)

    def list_invocations(self, status: str | None = None) -> list[InvocationRecord]:
        with self._connection("list invocations") as conn:
            if status is None:
                rows = conn.execute(
                    "SELECT invocation_id, data FROM invocations ORDER BY created_at, invocation_id"
                ).fetchall()
            else:
                rows = conn.execute(
                    "SELECT invocation_id, data FROM invocations WHERE status = ? ORDER BY created_at, invocation_id",
                    (status,),
                ).fetchall()
        return [self._decode(data, InvocationRecord, key) for key, data in rows]

    def delete_expired_invocations(self, now: float) -> int:
        with self._connection("delete expired invocations") as conn:
            cursor = conn.execute("DELETE FROM invocations WHERE expires_at <= ?", (now,))
        return cursor.rowcount

    # Usage

    def put_usage(self, record: UsageRecord) -> None:
        data = msgspec.json.encode(record).decode()
        with self._connection(f"store the usage of invocation {record.invocation_id!r}") as conn:
            conn.execute("INSERT OR REPLACE INTO usage (invocation_id, tenant, finished_at, data) VALUES (?, ?, ?, ?)",
                         (record.invocation_id, record.tenant, record.finished_at, data))

    def list_usage(self, since: float | None = None, until: float | None = None,
                   tenant: str | None = None) -> list[UsageRecord]:
        clauses = ["finished_at >= ?", "finished_at < ?"]
        values: list[float | str] = [float("-inf") if since is None else since,
                                     float("inf") if until is None else until]
        if tenant is not None:
            clauses.append("tenant = ?")
            values.append(tenant)
        with self._connection("list usage") as conn:
            rows = conn.execute(f"SELECT invocation_id, data FROM usage WHERE {' AND '.join(clauses)} "
                                "ORDER BY finished_at, invocation_id", values).fetchall()
        return [self._decode(data, UsageRecord, key) for key, data in rows]

    # API keys

    def put_key(self, record: ApiKeyRecord) -> None:
        data = msgspec.json.encode(record).decode()
        with self._connection(f"store API key {record.key_id!r}") as conn:
            try:
                conn.execute(
                    "INSERT INTO api_keys (key_id, key_hash, tenant, data) VALUES (?, ?, ?, ?) "
                    "ON CONFLICT (key_id) DO UPDATE SET key_hash = excluded.key_hash, tenant = excluded.tenant, "
                    "data = excluded.data",
                    (record.key_id, record.key_hash, record.tenant, data),
                )
            except sqlite3.IntegrityError as exc:
                raise AlreadyExists(
                    f"API key {record.key_id!r}: another key id already has this key hash"
                ) from exc

    def find_key(self, key_hash: str) -> ApiKeyRecord | None:
        with self._connection("look up an API key") as conn:
            row = conn.execute("SELECT key_id, data FROM api_keys WHERE key_hash = ?", (key_hash,)).fetchone()
        return None if row is None else self._decode(row[1], ApiKeyRecord, row[0])

    def list_keys(self, tenant: str | None = None) -> list[ApiKeyRecord]:
        with self._connection("list API keys") as conn:
            if tenant is None:
                rows = conn.execute("SELECT key_id, data FROM api_keys ORDER BY tenant, key_id").fetchall()
            else:
                rows = conn.execute(
                    "SELECT key_id, data FROM api_keys WHERE tenant = ? ORDER BY key_id", (tenant,)
                ).fetchall()
        return [self._decode(data, ApiKeyRecord, key) for key, data in rows]

    def delete_key(self, key_id: str) -> None:
        with self._connection(f"delete API key {key_id!r}") as conn:
            cursor = conn.execute("DELETE FROM api_keys WHERE key_id = ?", (key_id,))
        if cursor.rowcount == 0:
            raise ApiKeyNotFound(f"API key {key_id!r} does not exist")

    def touch_key(self, key_id: str, used_at: float) -> None:
        with self._connection(f"record the use of API key {key_id!r}") as conn:
            conn.execute("UPDATE api_keys SET data = json_set(data, '$.last_used_at', ?) WHERE key_id = ?",
                         (used_at, key_id))

    def ping(self) -> None:
        with self._connection("answer a ping") as conn:
            conn.execute("SELECT count(*) FROM functions").fetchone()

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
