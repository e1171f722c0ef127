import hashlib
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from lorafaas.errors import ApiKeyNotFound, Forbidden, InvalidInput, InvalidName, Unauthorized
from lorafaas.platform.auth import (
    ADMIN_KEY_FILE,
    authenticate,
    create_key,
    ensure_admin_key,
    hash_key,
    key_id_of,
    new_key,
    read_admin_key,
    revoke_key,
)
from lorafaas.platform.state.sqlite import SQLiteStore

ENV_KEY = "env-admin-key-0123456789abcdef"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SQLiteStore]:
    with SQLiteStore(tmp_path / "state" / "state.db") as store:
        yield store


def test_new_keys_are_random_and_carry_their_id() -> None:
    key, key_id = new_key()
    assert re.fullmatch(r"lf_[0-9a-f]{12}_[A-Za-z0-9_-]{43}", key), key
    assert key.startswith(f"lf_{key_id}_")
    assert new_key()[0] != key
    assert hash_key(key) == hashlib.sha256(key.encode()).hexdigest()


def test_keys_are_stored_only_as_hashes(store: SQLiteStore, tmp_path: Path) -> None:
    key = create_key(store, "acme")
    secret = key.split("_", 2)[2]  # lf_<id>_<secret>: the secret may itself hold underscores
    [record] = store.list_keys("acme")
    assert record.key_hash == hash_key(key)
    assert not record.is_admin
    store.close()
    for path in (tmp_path / "state").iterdir():  # state.db and its WAL
        assert secret.encode() not in path.read_bytes(), path.name


def test_authenticate_accepts_a_stored_key(store: SQLiteStore) -> None:
    key = create_key(store, "acme", is_admin=True)
    record = authenticate(store, f"Bearer {key}")
    assert (record.tenant, record.is_admin) == ("acme", True)
    assert authenticate(store, f"  bearer   {key} ") == record


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (None, "missing API key"),
        ("", "missing API key"),
        ("   ", "missing API key"),
        ("Basic dXNlcjpwYXNz", "malformed Authorization header"),
        ("Bearer", "malformed Authorization header"),
        ("Bearer two words", "malformed Authorization header"),
        ("lf_0123456789ab_secret", "malformed Authorization header"),
        ("Bearer lf_0123456789ab_not-a-real-secret", "unknown API key '0123456789ab'"),
        ("Bearer some-other-token", "unknown API key: it was never issued"),
    ],
)
def test_authenticate_refuses_with_401(store: SQLiteStore, header: str | None, message: str) -> None:
    create_key(store, "acme")
    with pytest.raises(Unauthorized, match=message) as err:
        authenticate(store, header)
    assert (err.value.http_status, err.value.code) == (401, "unauthorized")
    assert "secret" not in err.value.message
    assert "dXNlcjpwYXNz" not in err.value.message


def test_a_deleted_key_no_longer_authenticates(store: SQLiteStore) -> None:
    key = create_key(store, "acme")
    [record] = store.list_keys()
    store.delete_key(record.key_id)
    with pytest.raises(Unauthorized, match="unknown API key"):
        authenticate(store, f"Bearer {key}")


def test_tenant_names_are_checked(store: SQLiteStore) -> None:
    with pytest.raises(InvalidName, match="tenant name 'Acme Corp'"):
        create_key(store, "Acme Corp")
    assert store.list_keys() == []


def test_admin_key_is_made_once_and_kept_private(store: SQLiteStore, tmp_path: Path) -> None:
    home = tmp_path / "home"
    key = ensure_admin_key(store, home, None)
    assert key is not None
    key_file = home / ADMIN_KEY_FILE
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert key_file.read_text().strip() == key
    record = authenticate(store, f"Bearer {key}")
    assert (record.tenant, record.is_admin) == ("admin", True)
    assert ensure_admin_key(store, home, None) is None  # a later start prints nothing
    assert key_file.read_text().strip() == key
    assert len(store.list_keys()) == 1
    assert [p.name for p in home.iterdir()] == [ADMIN_KEY_FILE], "temporary key file left behind"


def test_admin_key_file_is_stored_again_in_a_fresh_state_store(store: SQLiteStore, tmp_path: Path) -> None:
    home = tmp_path / "home"
    key = ensure_admin_key(store, home, None)
    with SQLiteStore(tmp_path / "other" / "state.db") as fresh:
        assert ensure_admin_key(fresh, home, None) is None
        assert authenticate(fresh, f"Bearer {key}").is_admin


def test_two_starts_at_once_make_one_admin_key(store: SQLiteStore, tmp_path: Path) -> None:
    home = tmp_path / "home"
    results: list[str | None] = []
    barrier = threading.Barrier(4)

    def start() -> None:
        barrier.wait()
        results.append(ensure_admin_key(store, home, None))

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    made = [r for r in results if r is not None]
    assert len(made) == 1
    assert read_admin_key(home) == made[0]
    assert authenticate(store, f"Bearer {made[0]}").is_admin


def test_env_admin_key_is_stored_hashed_and_rotates(store: SQLiteStore, tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert ensure_admin_key(store, home, ENV_KEY) is None
    assert not (home / ADMIN_KEY_FILE).exists()
    record = authenticate(store, f"Bearer {ENV_KEY}")
    assert (record.tenant, record.is_admin, record.key_hash) == ("admin", True, hash_key(ENV_KEY))
    assert ensure_admin_key(store, home, ENV_KEY) is None
    assert len(store.list_keys()) == 1
    rotated = ENV_KEY + "-rotated"
    ensure_admin_key(store, home, rotated)
    assert authenticate(store, f"Bearer {rotated}").is_admin
    with pytest.raises(Unauthorized):
        authenticate(store, f"Bearer {ENV_KEY}")
    assert len(store.list_keys()) == 1


def test_weak_env_admin_key_is_refused(store: SQLiteStore, tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="LORAFAAS_ADMIN_KEY has 6 characters; it needs at least 16"):
        ensure_admin_key(store, tmp_path, "secret")
    assert store.list_keys() == []


def test_a_loose_key_file_mode_is_tightened(store: SQLiteStore, tmp_path: Path) -> None:
    key = ensure_admin_key(store, tmp_path, None)
    (tmp_path / ADMIN_KEY_FILE).chmod(0o644)
    assert read_admin_key(tmp_path) == key
    assert (tmp_path / ADMIN_KEY_FILE).stat().st_mode & 0o777 == 0o600


def test_a_keys_last_use_is_stored_once_a_minute(store: SQLiteStore, monkeypatch: pytest.MonkeyPatch) -> None:
    key = create_key(store, "acme")
    assert store.list_keys()[0].last_used_at is None
    first = authenticate(store, f"Bearer {key}").last_used_at
    assert store.list_keys()[0].last_used_at == first
    writes = []
    monkeypatch.setattr(store, "touch_key", lambda key_id, at: writes.append(at))
    authenticate(store, f"Bearer {key}")
    assert writes == []  # within the minute: no write per request


@pytest.mark.parametrize("tenant", ["admin", "system", "lorafaas"])
def test_reserved_tenant_names_get_no_key(store: SQLiteStore, tenant: str) -> None:
    with pytest.raises(Forbidden, match="reserved"):
        create_key(store, tenant)


def test_tenant_keys_are_revoked_and_admin_keys_are_not(store: SQLiteStore, tmp_path: Path) -> None:
    key = create_key(store, "acme")
    admin = ensure_admin_key(store, tmp_path, None)
    revoked = revoke_key(store, key_id_of(key))
    assert revoked.tenant == "acme"
    with pytest.raises(Unauthorized, match="revoked"):
        authenticate(store, f"Bearer {key}")
    with pytest.raises(ApiKeyNotFound):
        revoke_key(store, key_id_of(key))
    with pytest.raises(Forbidden, match="admin key"):
        revoke_key(store, key_id_of(admin))
    assert authenticate(store, f"Bearer {admin}").is_admin
