"""The state store interface, one for a machine (SQLite file) and a cluster (Redis), and `open_store(url)`.

Every method is a single atomic operation against the backend; callers need no locks of their own. Absent records
raise the NotFound subclass of their kind; an unreachable backend raises StoreUnavailable (HTTP 503), so a gateway
answers 503 while the store is down and recovers by itself once it is back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable
from urllib.parse import urlsplit

from lorafaas.errors import InvalidInput
from lorafaas.platform.state.records import ApiKeyRecord, FunctionSpec, InvocationRecord, UsageRecord

STATE_FILE = "state.db"
SQLITE_SCHEME = "sqlite://"
REDIS_SCHEMES = ("redis", "rediss")


@runtime_checkable
class StateStore(Protocol):
    # Functions: the desired state, persisted before anything acts on it.
    def put_function(self, spec: FunctionSpec, *, create: bool) -> None:
        """create=True: AlreadyExists if the name is taken; create=False (an update): FunctionNotFound if absent."""
        ...

    def get_function(self, name: str) -> FunctionSpec:
        """FunctionNotFound if absent."""
        ...

    def list_functions(self, tenant: str | None = None) -> list[FunctionSpec]:
        """All functions (or one tenant's), sorted by name."""
        ...

    def delete_function(self, name: str) -> None:
        """FunctionNotFound if absent."""
        ...

    # Invocations: written at each status change; removed once past `expires_at`.
    def put_invocation(self, record: InvocationRecord) -> None:
        """Insert or replace by invocation_id."""
        ...

    def get_invocation(self, invocation_id: str) -> InvocationRecord:
        """InvocationNotFound if absent (never issued, or expired and deleted)."""
        ...

    def list_invocations(self, status: str | None = None) -> list[InvocationRecord]:
        """All invocations (or those in one status), oldest first (created_at, then invocation_id)."""
        ...

    def delete_expired_invocations(self, now: float) -> int:
        """Delete every invocation with expires_at <= now; return how many."""
        ...

    # Usage: one record per finished invocation, kept for good (what a tenant is billed).
    def put_usage(self, record: UsageRecord) -> None:
        """Insert or replace by invocation_id."""
        ...

    def list_usage(self, since: float | None = None, until: float | None = None,
                   tenant: str | None = None) -> list[UsageRecord]:
        """Records with since <= finished_at < until (either bound optional), of one tenant or all, oldest first
        (finished_at, then invocation_id)."""
        ...

    # API keys: only hashes are stored.
    def put_key(self, record: ApiKeyRecord) -> None:
        """Insert or replace by key_id; AlreadyExists if another key_id already has this key_hash."""
        ...

    def find_key(self, key_hash: str) -> ApiKeyRecord | None:
        ...

    def list_keys(self, tenant: str | None = None) -> list[ApiKeyRecord]:
        """All keys (or one tenant's), sorted by (tenant, key_id)."""
        ...

    def delete_key(self, key_id: str) -> None:
        """ApiKeyNotFound if absent."""
        ...

    def touch_key(self, key_id: str, used_at: float) -> None:
        """Record that the key authenticated a request at `used_at` (its record's `last_used_at`, as `find_key` and
        `list_keys` return it); a key deleted meanwhile is left deleted."""
        ...

    def ping(self) -> None:
        """Return if the backend answers; StoreUnavailable otherwise."""
        ...

    def close(self) -> None:
        ...


def sqlite_url(home: Path) -> str:
    """The embedded default: `sqlite:///<home>/state.db`."""
    return f"{SQLITE_SCHEME}{Path(home).expanduser().resolve() / STATE_FILE}"


def open_store(url: str) -> StateStore:
    """`sqlite:///abs/path.db` (the file and its directory are created) or `redis://host:port/db` (`rediss://`)."""
    if url.startswith(SQLITE_SCHEME):
        path = Path(url.removeprefix(SQLITE_SCHEME))
        if not path.is_absolute() or not path.name:
            raise InvalidInput(
                f"state store URL {url!r} has no absolute file path; expected sqlite:///abs/path/state.db"
            )
        from lorafaas.platform.state.sqlite import SQLiteStore

        return SQLiteStore(path)
    if urlsplit(url).scheme in REDIS_SCHEMES:
        from lorafaas.platform.state.redis_store import RedisStore

        return RedisStore(url)
    scheme = urlsplit(url).scheme or "(none)"
    raise InvalidInput(
        f"state store URL scheme {scheme!r} is not supported; expected sqlite:///abs/path.db or redis://host:port/db"
    )
