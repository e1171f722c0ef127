"""The cluster state store: Redis, through the official client (sync API).

Records are msgspec JSON strings under `lorafaas:`; indexes (hashes, sets, a sorted set) list them. Every write that
touches a record and its indexes is one Lua script, so it is atomic: two deploys of one name race inside Redis and
exactly one wins. Layout (P = prefix):

    P function:<name>            JSON FunctionSpec        P functions                hash name -> tenant
    P functions:tenant:<t>       set of names
    P invocation:<id>            JSON InvocationRecord    P invocations:status       hash id -> status
    P invocations:status:<s>     set of ids               P invocations:expires      sorted set id by expires_at
    P key:<key_id>               JSON ApiKeyRecord        P key_hash:<sha256>        key_id
    P keys:hash                  hash key_id -> sha256    P keys:tenant              hash key_id -> tenant
    P keys:tenant:<t>            set of key_ids           P keys:used                hash key_id -> last use
    P usage:<invocation_id>      JSON UsageRecord         P usage:time               sorted set id by finished_at
    P usage:tenant:<t>           sorted set id by finished_at

Connections are lazy and re-made after a failure; a call retries a few times with backoff, so a restarted Redis is
picked up by the next call. Anything Redis raises becomes StoreUnavailable, once, here. A Redis Cluster is not
supported (the scripts touch keys of several hash slots): use one Redis, with a replica or Sentinel for HA.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar, cast
from urllib.parse import urlsplit, urlunsplit

import msgspec
import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from lorafaas.errors import (
    AlreadyExists,
    ApiKeyNotFound,
    FunctionNotFound,
    InvocationNotFound,
    ServerError,
    StoreUnavailable,
)
from lorafaas.platform.state.records import ApiKeyRecord, FunctionSpec, InvocationRecord, UsageRecord

DEFAULT_PREFIX = "lorafaas:"
EXPIRE_BATCH = 500  # invocations deleted per script call, so one call never blocks Redis for long

# KEYS: record, functions hash, tenant set. ARGV: data, name, tenant. Returns 0 when the name is taken.
CREATE_FUNCTION = """
if redis.call('HEXISTS', KEYS[2], ARGV[2]) == 1 then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('SADD', KEYS[3], ARGV[2])
return 1
"""
# KEYS: record, functions hash, new tenant set. ARGV: data, name, tenant, tenant set prefix.
UPDATE_FUNCTION = """
local old_tenant = redis.call('HGET', KEYS[2], ARGV[2])
if not old_tenant then return 0 end
if old_tenant ~= ARGV[3] then redis.call('SREM', ARGV[4] .. old_tenant, ARGV[2]) end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('SADD', KEYS[3], ARGV[2])
return 1
"""
# KEYS: record, functions hash. ARGV: name, tenant set prefix.
DELETE_FUNCTION = """
local tenant = redis.call('HGET', KEYS[2], ARGV[1])
if not tenant then return 0 end
redis.call('DEL', KEYS[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('SREM', ARGV[2] .. tenant, ARGV[1])
return 1
"""
# KEYS: record, status hash, expiry zset. ARGV: data, id, status, expires_at, status set prefix.
PUT_INVOCATION = """
local old = redis.call('HGET', KEYS[2], ARGV[2])
if old and old ~= ARGV[3] then redis.call('SREM', ARGV[5] .. old, ARGV[2]) end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('SADD', ARGV[5] .. ARGV[3], ARGV[2])
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[2])
return 1
"""
# KEYS: record, time zset, tenant zset. ARGV: data, id, finished_at.
PUT_USAGE = """
redis.call('SET', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[2])
return 1
"""
# KEYS: expiry zset, status hash. ARGV: now, batch size, record prefix, status set prefix.
DELETE_EXPIRED = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
for _, id in ipairs(ids) do
  local status = redis.call('HGET', KEYS[2], id)
  if status then redis.call('SREM', ARGV[4] .. status, id) end
  redis.call('HDEL', KEYS[2], id)
  redis.call('DEL', ARGV[3] .. id)
  redis.call('ZREM', KEYS[1], id)
end
return #ids
"""
# KEYS: record, hash -> id, keys:hash, keys:tenant. ARGV: data, key_id, hash, tenant, hash prefix, tenant set prefix.
# Returns 0 when another key id owns this hash.
PUT_KEY = """
local owner = redis.call('GET', KEYS[2])
if owner and owner ~= ARGV[2] then return 0 end
local old_hash = redis.call('HGET', KEYS[3], ARGV[2])
if old_hash and old_hash ~= ARGV[3] then redis.call('DEL', ARGV[5] .. old_hash) end
local old_tenant = redis.call('HGET', KEYS[4], ARGV[2])
if old_tenant and old_tenant ~= ARGV[4] then redis.call('SREM', ARGV[6] .. old_tenant, ARGV[2]) end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], ARGV[2])
redis.call('HSET', KEYS[3], ARGV[2], ARGV[3])
redis.call('HSET', KEYS[4], ARGV[2], ARGV[4])
redis.call('SADD', ARGV[6] .. ARGV[4], ARGV[2])
return 1
"""
# KEYS: hash -> id, keys:used. ARGV: record prefix. Returns {record, last use or ''}.
FIND_KEY = """
local id = redis.call('GET', KEYS[1])
if not id then return false end
local data = redis.call('GET', ARGV[1] .. id)
if not data then return false end
return {data, redis.call('HGET', KEYS[2], id) or ''}
"""
# KEYS: record, keys:hash, keys:used. ARGV: key_id, time. Only a key that exists gets a last use.
TOUCH_KEY = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
"""
# KEYS: record, keys:hash, keys:tenant, keys:used. ARGV: key_id, hash prefix, tenant set prefix.
DELETE_KEY = """
local hash = redis.call('HGET', KEYS[2], ARGV[1])
if not hash then return 0 end
local tenant = redis.call('HGET', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[1], ARGV[2] .. hash)
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
if tenant then redis.call('SREM', ARGV[3] .. tenant, ARGV[1]) end
return 1
"""

R = TypeVar("R")


def redact_url(url: str) -> str:
    """The URL without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class RedisStore:
    def __init__(
        self,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        retries: int = 3,
        socket_timeout_s: float = 5.0,
        connect_timeout_s: float = 2.0,
    ) -> None:
        self.url = redact_url(url)
        self.prefix = prefix
        try:
            self._client = redis.Redis.from_url(
                url,
                socket_timeout=socket_timeout_s,
                socket_connect_timeout=connect_timeout_s,
                retry_on_timeout=True,
                retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries),
                health_check_interval=30,
            )
        except ValueError as exc:  # a malformed URL
            raise StoreUnavailable(f"cannot use Redis URL {self.url}: {exc}") from exc
        script = self._client.register_script
        self._create_function = script(CREATE_FUNCTION)
        self._update_function = script(UPDATE_FUNCTION)
        self._delete_function = script(DELETE_FUNCTION)
        self._put_invocation = script(PUT_INVOCATION)
        self._delete_expired = script(DELETE_EXPIRED)
        self._put_key = script(PUT_KEY)
        self._find_key = script(FIND_KEY)
        self._touch_key = script(TOUCH_KEY)
        self._delete_key = script(DELETE_KEY)
        self._put_usage = script(PUT_USAGE)

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r})"

    def __enter__(self) -> RedisStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @contextmanager
    def _redis(self, action: str) -> Iterator[redis.Redis]:
        try:
            yield self._client
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise StoreUnavailable(f"cannot reach Redis at {self.url} to {action}: {exc}") from exc
        except redis.RedisError as exc:
            raise StoreUnavailable(f"Redis at {self.url} failed to {action}: {exc}") from exc

    def _key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    def _decode(self, data: bytes | str, kind: type[R], key: str) -> R:
        try:
            return msgspec.json.decode(data, type=kind)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ServerError(f"Redis at {self.url}: the stored {kind.__name__} {key!r} is unreadable: {exc}") from exc

    def _get_many(self, record_kind: str, ids: list[str], kind: type[R], action: str) -> list[R]:
        if not ids:
            return []
        with self._redis(action) as client:
            values = client.mget([self._key(record_kind, i) for i in ids])
        # A record deleted between reading the index and the records is skipped.
        return [self._decode(v, kind, i) for i, v in zip(ids, values, strict=True) if v is not None]

    # Functions

    def put_function(self, spec: FunctionSpec, *, create: bool) -> None:
        data = msgspec.json.encode(spec)
        keys = [self._key("function", spec.name), self._key("functions"), self._key("functions", "tenant", spec.tenant)]
        with self._redis(f"store function {spec.name!r}"):
            if create:
                done = self._create_function(keys=keys, args=[data, spec.name, spec.tenant])
            else:
                done = self._update_function(
                    keys=keys, args=[data, spec.name, spec.tenant, self._key("functions", "tenant", "")]
                )
        if not done and create:
            raise AlreadyExists(f"function {spec.name!r} already exists; update or delete it first")
        if not done:
            raise FunctionNotFound(f"function {spec.name!r} does not exist; deploy it first")

    def get_function(self, name: str) -> FunctionSpec:
        with self._redis(f"read function {name!r}") as client:
            data = client.get(self._key("function", name))
        if data is None:
            raise FunctionNotFound(f"function {name!r} does not exist")
        return self._decode(data, FunctionSpec, name)

    def list_functions(self, tenant: str | None = None) -> list[FunctionSpec]:
        names: Iterable[bytes | str]
        with self._redis("list functions") as client:
            if tenant is None:
                names = client.hkeys(self._key("functions"))
            else:
                names = client.smembers(self._key("functions", "tenant", tenant))
        ids = sorted(_text(n) for n in names)
        return self._get_many("function", ids, FunctionSpec, "list functions")

    def delete_function(self, name: str) -> None:
        with self._redis(f"delete function {name!r}"):
            done = self._delete_function(
                keys=[self._key("function", name), self._key("functions")],
                args=[name, self._key("functions", "tenant", "")],
            )
        if not done:
            raise FunctionNotFound(f"function {name!r} does not exist")

    # Invocations

    def put_invocation(self, record: InvocationRecord) -> None:
        with self._redis(f"store invocation {record.invocation_id!r}"):
            self._put_invocation(
                keys=[
                    self._key("invocation", record.invocation_id),
                    self._key("invocations", "status"),
                    self._key("invocations", "expires"),
                ],
                args=[
                    msgspec.json.encode(record), record.invocation_id, record.status, repr(float(record.expires_at)),
                    self._key("invocations", "status", ""),
                ],
            )

    def get_invocation(self, invocation_id: str) -> InvocationRecord:
        with self._redis(f"read invocation {invocation_id!r}") as client:
            data = client.get(self._key("invocation", invocation_id))
        if data is None:
            raise InvocationNotFound(f"invocation {invocation_id!r} does not exist (never issued, or expired)")
        return self._decode(data, InvocationRecord, invocation_id)

    def list_invocations(self, status: str | None = None) -> list[InvocationRecord]:
        ids: Iterable[bytes | str]
        with self._redis("list invocations") as client:
            if status is None:
                ids = client.hkeys(self._key("invocations", "status"))
            else:
                ids = client.smembers(self._key("invocations", "status", status))
        records = self._get_many("invocation", [_text(i) for i in ids], InvocationRecord, "list invocations")
        return sorted(records, key=lambda r: (r.created_at, r.invocation_id))

    def delete_expired_invocations(self, now: float) -> int:
        total = 0
        keys = [self._key("invocations", "expires"), self._key("invocations", "status")]
        args: list[str | int] = [repr(float(now)), EXPIRE_BATCH, self._key("invocation", ""),
                                 self._key("invocations", "status", "")]
        with self._redis("delete expired invocations"):
            while True:
                deleted = int(self._delete_expired(keys=keys, args=args))
                total += deleted
                if deleted < EXPIRE_BATCH:
                    return total

    # Usage

    def put_usage(self, record: UsageRecord) -> None:
        with self._redis(f"store the usage of invocation {record.invocation_id!r}"):
            self._put_usage(
                keys=[self._key("usage", record.invocation_id), self._key("usage", "time"),
                      self._key("usage", "tenant", record.tenant)],
                args=[msgspec.json.encode(record), record.invocation_id, repr(float(record.finished_at))],
            )

    def list_usage(self, since: float | None = None, until: float | None = None,
                   tenant: str | None = None) -> list[UsageRecord]:
        index = self._key("usage", "time") if tenant is None else self._key("usage", "tenant", tenant)
        low = "-inf" if since is None else repr(float(since))
        high = "+inf" if until is None else f"({float(until)!r}"  # until is exclusive
        with self._redis("list usage") as client:
            ids = cast(list[bytes], client.zrangebyscore(index, low, high))  # members only: no withscores
        records = self._get_many("usage", [_text(i) for i in ids], UsageRecord, "list usage")
        return sorted(records, key=lambda r: (r.finished_at, r.invocation_id))

    # API keys

    def put_key(self, record: ApiKeyRecord) -> None:
        with self._redis(f"store API key {record.key_id!r}"):
            done = self._put_key(
                keys=[
                    self._key("key", record.key_id),
                    self._key("key_hash", record.key_hash),
                    self._key("keys", "hash"),
                    self._key("keys", "tenant"),
                ],
                args=[
                    msgspec.json.encode(record), record.key_id, record.key_hash, record.tenant,
                    self._key("key_hash", ""), self._key("keys", "tenant", ""),
                ],
            )
        if not done:
            raise AlreadyExists(f"API key {record.key_id!r}: another key id already has this key hash")

    def find_key(self, key_hash: str) -> ApiKeyRecord | None:
        with self._redis("look up an API key"):
            found = self._find_key(keys=[self._key("key_hash", key_hash), self._key("keys", "used")],
                                   args=[self._key("key", "")])
        if found is None:
            return None
        data, used = found
        return _with_last_use(self._decode(data, ApiKeyRecord, key_hash[:12]), used)

    def list_keys(self, tenant: str | None = None) -> list[ApiKeyRecord]:
        ids: Iterable[bytes | str]
        with self._redis("list API keys") as client:
            if tenant is None:
                ids = client.hkeys(self._key("keys", "tenant"))
            else:
                ids = client.smembers(self._key("keys", "tenant", tenant))
            used = client.hgetall(self._key("keys", "used"))
        records = self._get_many("key", [_text(i) for i in ids], ApiKeyRecord, "list API keys")
        records = [_with_last_use(r, used.get(r.key_id.encode())) for r in records]
        return sorted(records, key=lambda r: (r.tenant, r.key_id))

    def delete_key(self, key_id: str) -> None:
        with self._redis(f"delete API key {key_id!r}"):
            done = self._delete_key(
                keys=[self._key("key", key_id), self._key("keys", "hash"), self._key("keys", "tenant"),
                      self._key("keys", "used")],
                args=[key_id, self._key("key_hash", ""), self._key("keys", "tenant", "")],
            )
        if not done:
            raise ApiKeyNotFound(f"API key {key_id!r} does not exist")

    def touch_key(self, key_id: str, used_at: float) -> None:
        with self._redis(f"record the use of API key {key_id!r}"):
            self._touch_key(keys=[self._key("key", key_id), self._key("keys", "used")], args=[key_id, repr(used_at)])

    def ping(self) -> None:
        with self._redis("answer a ping") as client:
            client.ping()

    def close(self) -> None:
        self._client.close()


def _text(value: bytes | str) -> str:
    """A member or key as the client returns it (bytes: the client does not decode responses)."""
    return value.decode() if isinstance(value, bytes) else value


def _with_last_use(record: ApiKeyRecord, used: bytes | str | None) -> ApiKeyRecord:
    return msgspec.structs.replace(record, last_used_at=float(used)) if used else record
