"""The adapter store: validated LoRA adapters under `$LORAFAAS_HOME/adapters/<sha256>/`, addressed by content.

An entry holds exactly adapter_config.json and adapter_model.safetensors; its name is the sha256 over those two
files' bytes, in that order. Entries are written to a hidden staging directory beside them and renamed into place, so
a reader never sees half an adapter and a failed copy leaves nothing. An entry never changes once visible: putting
the same bytes again is a no-op, and a function spec naming a digest always gets the bytes it was deployed with.

Entries no function references are removed by `collect` (after a delete, an update that replaced an adapter, a
failed deploy). A digest `put` returns is pinned until `unpin`: the caller writes the function that references it in
between, so a concurrent collect never removes an adapter a deploy is about to use. Pins live in this process: one
gateway per adapter store (the chart runs one).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from lorafaas.errors import AdapterNotFound, ServerError
from lorafaas.formats.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from lorafaas.formats.model_store import ModelStore
from lorafaas.models.adapter_validation import validate_adapter
from lorafaas.platform.adapter_upload import storage_error
from lorafaas.platform.state.records import DIGEST_PATTERN, check_digest

logger = logging.getLogger(__name__)

ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)  # hashed in this order
COPY_CHUNK_BYTES = 8 * 1024 * 1024
STAGING_PREFIX = ".incoming-"
DELETING_PREFIX = ".deleting-"
STALE_STAGING_S = 3600.0  # a staging directory this old belongs to a put that was killed
STALE_SWEEP_EVERY_S = 60.0


class AdapterStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._lock = threading.Lock()  # orders pins against collect (puts run in worker threads)
        self._pins: Counter[str] = Counter()
        self._swept_at = -STALE_SWEEP_EVERY_S

    def path(self, digest: str) -> Path:
        """The entry's directory; AdapterNotFound if there is none."""
        if not self.exists(digest):
            raise AdapterNotFound(
                f"adapter {digest[:12]} is not in the adapter store; deploy its function again to store it"
            )
        return self.root / digest

    def size_bytes(self, digest: str) -> int:
        """Bytes the entry takes (its two files); 0 if it is absent."""
        entry = self.root / check_digest(digest)
        return sum((entry / name).stat().st_size for name in ADAPTER_FILES if (entry / name).is_file())

    def unpin(self, digest: str) -> None:
        """Release the pin `put` took: the digest is referenced by a stored function now, or abandoned."""
        with self._lock:
            self._pins[digest] -= 1
            if self._pins[digest] <= 0:
                del self._pins[digest]

    def collect(self, referenced: set[str]) -> list[str]:
        """Remove every entry neither in `referenced` nor pinned; returns the digests removed."""
        removed = []
        with self._lock:
            for digest in self.list_digests():
                if digest not in referenced and digest not in self._pins:
                    self._remove(self.root / digest)
                    removed.append(digest)
        for digest in removed:
            logger.info("removed adapter %s: no function uses it", digest[:12])
        return removed

    def exists(self, digest: str) -> bool:
        entry = self.root / check_digest(digest)
        return all((entry / name).is_file() for name in ADAPTER_FILES)

    def list_digests(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if DIGEST_PATTERN.match(p.name) and self.exists(p.name))

    def put(self, adapter_dir: Path, store: ModelStore, backbone: str) -> str:
        """Validate the adapter against `backbone`, store it, and return its digest, pinned (see `unpin`).

        Raises what `validate_adapter` raises (AdapterInvalid, AdapterIncompatible, PickledWeightsRefused,
        BackboneNotFound) before anything is written, and ServerError if the copy fails (nothing is left then).
        """
        adapter_dir = Path(adapter_dir).expanduser()
        validate_adapter(adapter_dir, store, backbone)
        with self.staging() as staged:
            try:
                for name in ADAPTER_FILES:
                    copy_file(adapter_dir / name, staged / name)
            except OSError as exc:  # disk full, source gone: nothing was stored
                raise storage_error(exc, "cannot copy the adapter into the adapter store") from exc
            return self._commit(staged)

    def put_staged(self, staged: Path, store: ModelStore, backbone: str) -> str:
        """`put` for files already written into a `staging()` directory (an upload unpacked there): validated,
        then moved into place, never copied."""
        validate_adapter(staged, store, backbone)
        return self._commit(staged)

    @contextlib.contextmanager
    def staging(self) -> Iterator[Path]:
        """A new staging directory in the store (the entries' file system: the move into place is a rename); what is
        left in it is removed after."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.root.chmod(0o700)  # a store made by an older version was world-readable
        self._remove_stale_staging()
        staged = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=self.root))
        try:
            yield staged
        finally:
            shutil.rmtree(staged, ignore_errors=True)

    def _commit(self, staged: Path) -> str:
        hasher = hashlib.sha256()
        try:
            for name in ADAPTER_FILES:
                hash_and_sync(staged / name, hasher)
        except OSError as exc:
            raise storage_error(exc, "cannot write the adapter into the adapter store") from exc
        digest = hasher.hexdigest()
        with self._lock:
            self._move_into_place(staged, digest)
            self._pins[digest] += 1
        logger.info("stored adapter %s", digest[:12])
        return digest

    def _move_into_place(self, staging: Path, digest: str) -> None:
        if self.exists(digest):
            return
        entry = self.root / digest
        if entry.exists():  # files removed from an entry by hand: replace it whole
            logger.warning("adapter %s at %s is incomplete; replacing it", digest[:12], entry)
            self._remove(entry)
        for name in ADAPTER_FILES:  # the platform's own user only (its function processes run as it)
            (staging / name).chmod(0o600)
        staging.chmod(0o700)
        try:
            os.rename(staging, entry)
        except OSError as exc:
            if self.exists(digest):  # a concurrent put of the same bytes won the race
                return
            logger.error("cannot move adapter %s into place at %s: %s", digest[:12], entry, exc)
            raise ServerError(f"cannot move adapter {digest[:12]} into place ({exc.strerror})") from exc
        _fsync_dir(self.root)

    def delete(self, digest: str) -> None:
        """Remove an entry (AdapterNotFound if absent); it disappears at once, then its files are removed."""
        self.path(digest)
        self._remove(self.root / digest)

    def _remove(self, entry: Path) -> None:
        doomed = Path(tempfile.mkdtemp(prefix=DELETING_PREFIX, dir=self.root))
        with contextlib.suppress(FileNotFoundError):  # deleted concurrently
            os.rename(entry, doomed / entry.name)
        shutil.rmtree(doomed, ignore_errors=True)

    def _remove_stale_staging(self) -> None:
        # at most once a minute: a listing of the store's thousands of entries is not paid on every put
        if time.monotonic() - self._swept_at < STALE_SWEEP_EVERY_S:
            return
        self._swept_at = time.monotonic()
        cutoff = time.time() - STALE_STAGING_S
        for path in self.root.iterdir():
            if path.name.startswith((STAGING_PREFIX, DELETING_PREFIX)):
                try:
                    if path.stat().st_mtime < cutoff:
                        shutil.rmtree(path, ignore_errors=True)
                except FileNotFoundError:
                    pass


def copy_file(src: Path, dst: Path) -> None:
    """Copy `src` to `dst`; `_commit` hashes and fsyncs it."""
    shutil.copyfile(src, dst)


def hash_and_sync(path: Path, hasher: hashlib._Hash) -> None:
    """Feed the file's bytes to `hasher` and fsync it: on disk when this returns."""
    with path.open("rb") as file:
        while chunk := file.read(COPY_CHUNK_BYTES):
            hasher.update(chunk)
        os.fsync(file.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
