"""API keys: `lf_<key_id>_<secret>`, stored only as a sha256, presented as `Authorization: Bearer <key>`.

The secret is 256 random bits, so an unsalted sha256 is as strong as a slow hash here and costs one lookup per
request. The key id is public (listings, logs, revocation); the plaintext is shown once, when the key is made. Each
key's last use is stored to the minute (one write per key and minute, not one per request).

The admin key comes from `LORAFAAS_ADMIN_KEY` when set (any string of 16+ characters; stored under the fixed id
`admin-env`, so changing the variable revokes the previous one); otherwise it is made at first start and kept in
`$LORAFAAS_HOME/admin.key` (mode 0600), which a local CLI reads.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import tempfile
import time
from pathlib import Path

import msgspec

from lorafaas.errors import ApiKeyNotFound, Forbidden, InvalidInput, Unauthorized
from lorafaas.formats.model_store import check_name
from lorafaas.platform.state.interface import StateStore
from lorafaas.platform.state.records import ApiKeyRecord

logger = logging.getLogger(__name__)

KEY_PREFIX = "lf_"
KEY_ID_BYTES = 6  # 12 hex characters
SECRET_BYTES = 32
ADMIN_TENANT = "admin"
ADMIN_KEY_FILE = "admin.key"
ENV_ADMIN_KEY_ID = "admin-env"
MIN_ENV_KEY_CHARS = 16
BEARER = "bearer"
# Tenant names a key may not be made for: the admin key's own tenant, and names that read as the platform's.
RESERVED_TENANTS = frozenset({ADMIN_TENANT, "root", "system", "lorafaas", "platform"})
KEY_USE_RESOLUTION_S = 60.0


class KeyInfo(msgspec.Struct, kw_only=True):
    """A key as GET /v1/keys lists it (never the key itself); `lorafaas keys list` decodes it."""

    key_id: str
    tenant: str
    is_admin: bool
    created_at: float
    last_used_at: float | None

    @classmethod
    def of(cls, record: ApiKeyRecord) -> KeyInfo:
        return cls(key_id=record.key_id, tenant=record.tenant, is_admin=record.is_admin,
                   created_at=record.created_at, last_used_at=record.last_used_at)


def new_key() -> tuple[str, str]:
    """A fresh (plaintext key, key_id)."""
    key_id = secrets.token_hex(KEY_ID_BYTES)  # hex: never contains the '_' that separates the parts
    return f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(SECRET_BYTES)}", key_id


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(store: StateStore, tenant: str, is_admin: bool = False) -> str:
    """Store a new key for `tenant` and return its plaintext, which is not kept anywhere."""
    check_name(tenant, "tenant")
    if tenant in RESERVED_TENANTS and not is_admin:
        raise Forbidden(f"tenant name {tenant!r} is reserved (reserved: {', '.join(sorted(RESERVED_TENANTS))}); "
                        "choose another")
    key, key_id = new_key()
    store.put_key(
        ApiKeyRecord(key_id=key_id, tenant=tenant, key_hash=hash_key(key), is_admin=is_admin, created_at=time.time())
    )
    logger.info("created API key %s for tenant %s%s", key_id, tenant, " (admin)" if is_admin else "")
    return key


def key_id_of(key: str) -> str | None:
    """The public id inside an `lf_<key_id>_<secret>` key (None for another format), safe to show or log."""
    if not key.startswith(KEY_PREFIX):
        return None
    key_id, sep, secret = key.removeprefix(KEY_PREFIX).partition("_")
    return key_id if sep and key_id and secret else None


def authenticate(store: StateStore, authorization_header_value: str | None) -> ApiKeyRecord:
    """The stored record of the key in an `Authorization: Bearer <key>` header; Unauthorized otherwise."""
    if not authorization_header_value or not authorization_header_value.strip():
        raise Unauthorized("missing API key: send the header 'Authorization: Bearer <key>'")
    scheme, _, key = authorization_header_value.strip().partition(" ")
    key = key.strip()
    if scheme.lower() != BEARER or not key or any(c.isspace() for c in key):
        # The value is never echoed: a key sent without its scheme would land in a response and a log.
        problem = "no 'Bearer' scheme" if scheme.lower() != BEARER else "not exactly one key after 'Bearer'"
        raise Unauthorized(f"malformed Authorization header ({problem}); expected 'Authorization: Bearer <key>'")
    record = store.find_key(hash_key(key))
    if record is None:
        shown = key_id_of(key)
        raise Unauthorized(f"unknown API key{f' {shown!r}' if shown else ''}: it was never issued or was revoked")
    now = round(time.time(), 3)  # milliseconds: exact through SQLite's JSON (15 significant digits)
    if record.last_used_at is None or now - record.last_used_at >= KEY_USE_RESOLUTION_S:
        store.touch_key(record.key_id, now)
        record = msgspec.structs.replace(record, last_used_at=now)
    return record


def revoke_key(store: StateStore, key_id: str) -> ApiKeyRecord:
    """Delete a tenant's key: the next request with it is 401. Admin keys are not revoked here (that would lock
    the platform out): change LORAFAAS_ADMIN_KEY, or delete admin.key and restart."""
    record = next((k for k in store.list_keys() if k.key_id == key_id), None)
    if record is None:
        raise ApiKeyNotFound(f"API key {key_id!r} does not exist")
    if record.is_admin:
        raise Forbidden(f"key {key_id!r} is the admin key; replace it by changing LORAFAAS_ADMIN_KEY (or deleting "
                        "admin.key) and restarting the platform")
    store.delete_key(key_id)
    logger.info("revoked API key %s of tenant %s", key_id, record.tenant)
    return record


def ensure_admin_key(store: StateStore, home: Path, env_key: str | None) -> str | None:
    """Make sure an admin key exists; return its plaintext only when it was just made (to be printed once)."""
    if env_key is not None:
        _store_admin_key(store, _check_env_key(env_key), ENV_ADMIN_KEY_ID)
        return None
    key_file = Path(home) / ADMIN_KEY_FILE
    if key_file.exists():
        key = read_admin_key(home)
        key_id = key_id_of(key)
        if key_id is None:
            raise InvalidInput(f"{key_file} does not hold a lorafaas key (lf_...); delete it to make a new one")
        _store_admin_key(store, key, key_id)  # e.g. a fresh state store next to an old home
        return None
    key, key_id = new_key()
    if not _write_key_file(key_file, key):  # another `lorafaas up` made one first: use theirs
        return ensure_admin_key(store, home, None)
    _store_admin_key(store, key, key_id)
    logger.info("created the admin key %s in %s", key_id, key_file)
    return key


def read_admin_key(home: Path) -> str:
    """The admin key kept in `home/admin.key` (for a local CLI); restores the file's 0600 mode if it drifted."""
    key_file = Path(home) / ADMIN_KEY_FILE
    if key_file.stat().st_mode & 0o077:
        logger.warning("%s is readable by others; setting its mode to 0600", key_file)
        with contextlib.suppress(PermissionError):  # not ours to change; reading it is still allowed
            key_file.chmod(0o600)
    return key_file.read_text().strip()


def _check_env_key(key: str) -> str:
    if len(key) < MIN_ENV_KEY_CHARS or any(c.isspace() for c in key):
        raise InvalidInput(
            f"LORAFAAS_ADMIN_KEY has {len(key)} characters; it needs at least {MIN_ENV_KEY_CHARS} and no "
            'whitespace (e.g. `python -c "import secrets; print(secrets.token_urlsafe(32))"`)'
        )
    return key


def _store_admin_key(store: StateStore, key: str, key_id: str) -> None:
    key_hash = hash_key(key)
    found = store.find_key(key_hash)
    if found is not None and found.is_admin:
        return
    if found is not None:
        raise InvalidInput(
            f"the admin key is already stored as key {found.key_id!r} of tenant {found.tenant!r} without admin "
            "rights; choose another admin key"
        )
    store.put_key(
        ApiKeyRecord(key_id=key_id, tenant=ADMIN_TENANT, key_hash=key_hash, is_admin=True, created_at=time.time())
    )


def _write_key_file(key_file: Path, key: str) -> bool:
    """Write the key with mode 0600, atomically and only if absent; False if the file already exists."""
    key_file.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".admin-key-", dir=key_file.parent)  # mkstemp creates it 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp_name, key_file)  # unlike rename, never replaces an existing file
        except FileExistsError:
            return False
        return True
    finally:
        os.unlink(tmp_name)
