"""The LoRA server's registered adapters, and whose they are.

A client names an adapter by an id of its own choosing that means something on its connection only: a call names an
id its connection registered, so one function cannot reach another's adapter by guessing its id, nor squat an id to
stop another from registering. Behind the ids, the server keys an adapter by what it reads: on the Unix socket a
directory the client opened itself and sent as a descriptor (its device and inode), read through that descriptor
(`/proc/self/fd/N`, never by a path the client could later swap; the weights opened without following a link), so
the server reads no adapter the client could not open; over TCP (no descriptors) a path, which the server reads with
its own rights. Connections that registered the same directory share its cache entry (the factors are the same); it
is forgotten when the last of them goes.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from lorafaas.errors import AdapterInvalid, InvalidInput
from lorafaas.formats.adapter_files import WEIGHTS_FILE
from lorafaas.formats.expert_adapters import (
    ExpertAdapterInfo,
    ExpertLayout,
    check_against_layout,
    read_expert_adapter_info,
)

MAX_ADAPTERS_PER_CONNECTION = 64


@dataclass
class _Entry:
    info: ExpertAdapterInfo
    fd: int | None  # the directory's descriptor the server reads through (Unix socket), None for a path
    holders: int = 0
    directory: tuple[int, int] | None = None


@dataclass
class AdapterRegistry:
    layout: ExpertLayout
    model_dir: str
    _entries: dict[str, _Entry] = field(default_factory=dict)  # server key -> entry
    _by_directory: dict[tuple[int, int], str] = field(default_factory=dict)  # (device, inode) -> key
    _generation: int = 0

    def register_fd(self, fd: int, said: str) -> tuple[str, ExpertAdapterInfo]:
        """The adapter in the directory `fd` (the caller's descriptor: this takes it over, and closes it if the
        directory is registered already). `said`: the path the client gave, for messages."""
        try:
            st = os.fstat(fd)
            if not stat.S_ISDIR(st.st_mode):
                raise AdapterInvalid(f"the descriptor sent for {said} is not a directory")
            directory = (st.st_dev, st.st_ino)
            key = self._by_directory.get(directory)
            if key is not None:
                os.close(fd)
                return key, self._hold(key)
            self._generation += 1  # a new key per registration: a reused inode never meets a stale cache entry
            key = f"dir:{st.st_dev}:{st.st_ino}:{self._generation}"
            path = Path(f"/proc/self/fd/{fd}")
            for name in os.listdir(path):  # a link inside could point at another adapter's files
                if stat.S_ISLNK(os.lstat(path / name).st_mode):
                    raise AdapterInvalid(f"{said} holds a symbolic link ({name}); an adapter sent by descriptor "
                                         "holds none")
            info = self._check(path)
        except BaseException:
            os.close(fd)
            raise
        self._entries[key] = _Entry(info, fd, directory=directory)
        self._by_directory[directory] = key
        return key, self._hold(key)

    def register_path(self, adapter_dir: str) -> tuple[str, ExpertAdapterInfo]:
        """The adapter at a path (TCP clients: no descriptors travel)."""
        key = f"path:{Path(adapter_dir).resolve()}"
        if key not in self._entries:
            self._entries[key] = _Entry(self._check(Path(adapter_dir)), None)
        return key, self._hold(key)

    def release(self, key: str) -> bool:
        """One holder of `key` let it go; True if it was the last (the caller forgets its cache entry)."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        entry.holders -= 1
        if entry.holders > 0:
            return False
        del self._entries[key]
        if entry.directory is not None:
            self._by_directory.pop(entry.directory, None)
        if entry.fd is not None:
            os.close(entry.fd)
        return True

    def info(self, key: str) -> ExpertAdapterInfo:
        return self._entries[key].info

    def open_weights(self, key: str) -> int | None:
        """A descriptor of the adapter's weights file, opened through its directory's descriptor without following a
        link (a client that can write its directory may have swapped the file for a link since it registered); None
        for an adapter registered by path. The caller closes it."""
        entry = self._entries[key]
        if entry.fd is None:
            return None
        try:
            return os.open(WEIGHTS_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=entry.fd)
        except OSError as exc:
            raise AdapterInvalid(f"{WEIGHTS_FILE} of a registered adapter cannot be opened (not a link): "
                                 f"{exc.strerror}") from exc

    def __len__(self) -> int:
        return len(self._entries)

    def _hold(self, key: str) -> ExpertAdapterInfo:
        entry = self._entries[key]
        entry.holders += 1
        return entry.info

    def _check(self, path: Path) -> ExpertAdapterInfo:
        info = read_expert_adapter_info(path)
        check_against_layout(info, self.layout, self.model_dir)
        return info


@dataclass
class ConnectionAdapters:
    """One connection's ids -> server keys."""

    registry: AdapterRegistry
    ids: dict[str, str] = field(default_factory=dict)

    def register(self, adapter_id: str, said: str, fd: int | None) -> ExpertAdapterInfo:
        if fd is not None:
            key, info = self.registry.register_fd(fd, said)
        else:
            key, info = self.registry.register_path(said)
        known = self.ids.get(adapter_id)
        if known is not None:
            self.registry.release(key)
            if known != key:
                raise InvalidInput(f"adapter id {adapter_id!r} is registered on this connection with another adapter")
            return info
        if len(self.ids) >= MAX_ADAPTERS_PER_CONNECTION:
            self.registry.release(key)
            raise InvalidInput(f"a connection registers at most {MAX_ADAPTERS_PER_CONNECTION} adapters")
        self.ids[adapter_id] = key
        return info

    def key(self, adapter_id: str) -> str:
        key = self.ids.get(adapter_id)
        if key is None:
            raise AdapterInvalid(f"adapter {adapter_id!r} is not registered on this connection")
        return key

    def release_all(self) -> list[str]:
        """Let every adapter go; the keys no connection holds any more."""
        gone = [key for key in self.ids.values() if self.registry.release(key)]
        self.ids.clear()
        return gone
