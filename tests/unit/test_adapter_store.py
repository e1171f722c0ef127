import hashlib
import json
import shutil
import threading
from pathlib import Path

import pytest

import lorafaas.platform.adapter_store as adapter_store_module
from lorafaas.errors import (
    AdapterIncompatible,
    AdapterInvalid,
    AdapterNotFound,
    BackboneNotFound,
    InvalidInput,
    PickledWeightsRefused,
    ServerError,
)
from lorafaas.formats.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from lorafaas.formats.model_store import ModelStore
from lorafaas.platform.adapter_store import AdapterStore


@pytest.fixture
def adapters(tmp_path: Path) -> AdapterStore:
    return AdapterStore(tmp_path / "adapters")


@pytest.fixture
def adapter_copy(tmp_path: Path, tiny_adapter_dir: Path) -> Path:
    """A private copy of the tiny adapter that a test may change."""
    return Path(shutil.copytree(tiny_adapter_dir, tmp_path / "my-adapter"))


def expected_digest(adapter_dir: Path) -> str:
    data = (adapter_dir / CONFIG_FILE).read_bytes() + (adapter_dir / WEIGHTS_FILE).read_bytes()
    return hashlib.sha256(data).hexdigest()


def root_entries(adapters: AdapterStore) -> list[str]:
    return sorted(p.name for p in adapters.root.iterdir()) if adapters.root.exists() else []


def test_put_stores_exactly_the_two_files_under_their_sha256(
    adapters: AdapterStore, adapter_copy: Path, tiny_store: ModelStore
) -> None:
    (adapter_copy / "README.md").write_text("not part of the adapter")
    digest = adapters.put(adapter_copy, tiny_store, "tiny-dense")
    assert digest == expected_digest(adapter_copy)
    entry = adapters.path(digest)
    assert entry == adapters.root / digest
    assert sorted(p.name for p in entry.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        assert (entry / name).read_bytes() == (adapter_copy / name).read_bytes()
    assert adapters.exists(digest)
    assert adapters.list_digests() == [digest]
    assert root_entries(adapters) == [digest], "staging directory left behind"


def test_stored_adapters_are_readable_by_the_platforms_user_only(
    adapters: AdapterStore, adapter_copy: Path, tiny_store: ModelStore
) -> None:
    """Issue 36 finding 12: stored adapters were world-readable (0644 files in 0755 directories)."""
    adapters.root.mkdir(mode=0o755)  # as an older version left it
    digest = adapters.put(adapter_copy, tiny_store, "tiny-dense")
    assert adapters.root.stat().st_mode & 0o777 == 0o700
    assert adapters.path(digest).stat().st_mode & 0o777 == 0o700
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        assert (adapters.path(digest) / name).stat().st_mode & 0o777 == 0o600
    adapters.delete(digest)
    assert not adapters.exists(digest) and root_entries(adapters) == []


def test_putting_the_same_bytes_again_is_a_no_op(
    adapters: AdapterStore, adapter_copy: Path, tiny_adapter_dir: Path, tiny_store: ModelStore
) -> None:
    digest = adapters.put(adapter_copy, tiny_store, "tiny-dense")
    weights = adapters.path(digest) / WEIGHTS_FILE
    before = weights.stat()
    assert adapters.put(tiny_adapter_dir, tiny_store, "tiny-dense") == digest  # other path, same bytes
    after = weights.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert root_entries(adapters) == [digest]


def test_other_bytes_get_another_digest(adapters: AdapterStore, adapter_copy: Path, tiny_store: ModelStore) -> None:
    first = adapters.put(adapter_copy, tiny_store, "tiny-dense")
    config = json.loads((adapter_copy / CONFIG_FILE).read_text())
    config["lora_dropout"] = 0.5
    (adapter_copy / CONFIG_FILE).write_text(json.dumps(config))
    second = adapters.put(adapter_copy, tiny_store, "tiny-dense")
    assert second != first
    assert adapters.list_digests() == sorted([first, second])
    assert json.loads((adapters.path(second) / CONFIG_FILE).read_text())["lora_dropout"] == 0.5


def test_refused_adapters_leave_nothing(adapters: AdapterStore, adapter_copy: Path, tiny_store: ModelStore) -> None:
    with pytest.raises(AdapterIncompatible):  # made for tiny-dense
        adapters.put(adapter_copy, tiny_store, "tiny-moe")
    with pytest.raises(BackboneNotFound):
        adapters.put(adapter_copy, tiny_store, "no-such-backbone")
    (adapter_copy / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(PickledWeightsRefused):
        adapters.put(adapter_copy, tiny_store, "tiny-dense")
    (adapter_copy / "adapter_model.bin").unlink()
    (adapter_copy / WEIGHTS_FILE).unlink()
    with pytest.raises(AdapterInvalid, match=WEIGHTS_FILE):
        adapters.put(adapter_copy, tiny_store, "tiny-dense")
    assert root_entries(adapters) == []


def test_a_copy_failing_midway_leaves_nothing_visible(
    adapters: AdapterStore, adapter_copy: Path, tiny_store: ModelStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_copy = adapter_store_module.copy_file
    seen_while_copying: list[list[str]] = []

    def copy_then_fail(src: Path, dst: Path) -> None:
        if src.name == WEIGHTS_FILE:
            seen_while_copying.append([n for n in root_entries(adapters) if not n.startswith(".")])
            raise OSError(28, "No space left on device")
        real_copy(src, dst)

    monkeypatch.setattr(adapter_store_module, "copy_file", copy_then_fail)
    with pytest.raises(ServerError, match="No space left on device"):
        adapters.put(adapter_copy, tiny_store, "tiny-dense")
    assert seen_while_copying == [[]], "the config file was visible before the weights were copied"
    assert root_entries(adapters) == []
    monkeypatch.setattr(adapter_store_module, "copy_file", real_copy)
    digest = adapters.put(adapter_copy, tiny_store, "tiny-dense")  # and a retry works
    assert adapters.list_digests() == [digest]


def test_concurrent_puts_of_one_adapter_store_it_once(
    adapters: AdapterStore, adapter_copy: Path, tiny_store: ModelStore
) -> None:
    digests: list[str] = []
    barrier = threading.Barrier(4)

    def put() -> None:
        barrier.wait()
        digests.append(adapters.put(adapter_copy, tiny_store, "tiny-dense"))

    threads = [threading.Thread(target=put) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert digests == [expected_digest(adapter_copy)] * 4
    assert root_entries(adapters) == [digests[0]]


def test_an_entry_damaged_by_hand_is_replaced(
    adapters: AdapterStore, adapter_copy: Path, tiny_store: ModelStore
) -> None:
    digest = adapters.put(adapter_copy, tiny_store, "tiny-dense")
    (adapters.root / digest / WEIGHTS_FILE).unlink()
    assert not adapters.exists(digest)
    assert adapters.put(adapter_copy, tiny_store, "tiny-dense") == digest
    assert (adapters.path(digest) / WEIGHTS_FILE).read_bytes() == (adapter_copy / WEIGHTS_FILE).read_bytes()


def test_delete_and_missing_digests(adapters: AdapterStore, adapter_copy: Path, tiny_store: ModelStore) -> None:
    digest = adapters.put(adapter_copy, tiny_store, "tiny-dense")
    adapters.delete(digest)
    assert not adapters.exists(digest)
    assert adapters.list_digests() == []
    assert root_entries(adapters) == []
    with pytest.raises(AdapterNotFound, match=f"adapter {digest[:12]} is not in the adapter store"):
        adapters.path(digest)
    with pytest.raises(AdapterNotFound):
        adapters.delete(digest)
    with pytest.raises(InvalidInput, match="64 lowercase hex"):
        adapters.path("../../etc")
    assert AdapterStore(adapters.root / "never-created").list_digests() == []


def test_collect_removes_unreferenced_entries_but_not_pinned_ones(
    adapters: AdapterStore, adapter_copy: Path, tiny_store: ModelStore
) -> None:
    first = adapters.put(adapter_copy, tiny_store, "tiny-dense")
    (adapter_copy / CONFIG_FILE).write_text((adapter_copy / CONFIG_FILE).read_text() + "\n")
    second = adapters.put(adapter_copy, tiny_store, "tiny-dense")
    assert adapters.collect(set()) == [], "a pinned digest (a deploy in progress) was removed"
    adapters.unpin(first)
    adapters.unpin(second)
    assert adapters.size_bytes(first) == sum((adapters.root / first / n).stat().st_size
                                             for n in (CONFIG_FILE, WEIGHTS_FILE))
    assert adapters.collect({second}) == [first]
    assert adapters.list_digests() == [second] and adapters.size_bytes(first) == 0
    assert adapters.collect(set()) == [second] and root_entries(adapters) == []


def test_missing_adapter_messages_name_no_server_path(adapters: AdapterStore) -> None:
    with pytest.raises(AdapterNotFound) as err:
        adapters.path("0" * 64)
    assert str(adapters.root) not in err.value.message


def test_an_upload_unpacked_into_staging_is_moved_into_place_not_copied(
    adapters: AdapterStore, adapter_copy: Path, tiny_store: ModelStore
) -> None:
    with adapters.staging() as staged:
        assert staged.parent == adapters.root and staged.name.startswith(".")  # never listed as an entry
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            shutil.copyfile(adapter_copy / name, staged / name)
        inode = (staged / WEIGHTS_FILE).stat().st_ino
        digest = adapters.put_staged(staged, tiny_store, "tiny-dense")
    assert digest == expected_digest(adapter_copy)
    assert (adapters.path(digest) / WEIGHTS_FILE).stat().st_ino == inode, "the staged file was copied"
    assert root_entries(adapters) == [digest]


def test_a_staged_adapter_refused_leaves_nothing(
    adapters: AdapterStore, adapter_copy: Path, tiny_store: ModelStore
) -> None:
    with adapters.staging() as staged:
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            shutil.copyfile(adapter_copy / name, staged / name)
        with pytest.raises(AdapterIncompatible):  # made for tiny-dense
            adapters.put_staged(staged, tiny_store, "tiny-moe")
    assert root_entries(adapters) == []
