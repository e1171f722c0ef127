"""What a local launcher has started, on disk, so that a platform killed with SIGKILL leaks nothing for good.

Each launcher keeps `$HOME/run/launcher-<pid>-<tag>.json`, locked with flock for its life (the kernel releases the
lock when the process dies, however it dies) and rewritten in place whenever it starts or stops a process: its zygote,
its backbone daemons and its function instances, each as (pid, start time) so that a pid reused by another process is
never mistaken for ours. A launcher that starts finds the unlocked records of dead launchers: it stops their zygote
and instances and adopts their daemons (the same backbones, already loaded).

The record is JSON (typed, versioned) for people reading `run/` too.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

from lorafaas.protocols.leases import process_alive, process_start_ticks

log = logging.getLogger(__name__)
RECORD_VERSION = 1
RECORD_GLOB = "launcher-*.json"


class ProcessRef(msgspec.Struct, frozen=True, kw_only=True):
    pid: int
    start_ticks: int | None  # None: it had exited when recorded

    @classmethod
    def of(cls, pid: int) -> ProcessRef:
        return cls(pid=pid, start_ticks=process_start_ticks(pid))

    def alive(self) -> bool:
        return self.start_ticks is not None and process_alive(self.pid, self.start_ticks)


class LauncherRecord(msgspec.Struct, frozen=True, kw_only=True):
    record_version: int = RECORD_VERSION
    launcher_pid: int
    device: str
    zygote: ProcessRef | None = None
    # the daemons this launcher started (or adopted) and stops, by `daemon_key`: `backbone@device`, or (as records
    # of one device wrote it) `backbone` alone for one on `device`
    daemons: dict[str, ProcessRef] = {}
    instances: tuple[ProcessRef, ...] = ()


def daemon_key(backbone: str, device: str) -> str:
    return f"{backbone}@{device}"


def parse_daemon_key(key: str, record_device: str) -> tuple[str, str]:
    """(backbone, device) of a record's daemon (a key without a device is one on the record's device)."""
    backbone, _, device = key.partition("@")
    return backbone, device or record_device


class RecordFile:
    """This launcher's record: created on the first write, removed by `remove()`."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / f"launcher-{os.getpid()}-{secrets.token_hex(3)}.json"
        self._fd: int | None = None

    def write(self, record: LauncherRecord) -> None:
        if self._fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)  # a new file of our own: never contended
            self._fd = fd
        data = msgspec.json.encode(record)
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def remove(self) -> None:
        if self._fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None


@contextlib.contextmanager
def dead_launchers(run_dir: Path) -> Iterator[list[tuple[Path, LauncherRecord]]]:
    """The records of launchers that died without cleaning up, locked while the caller recovers them; removed after."""
    held: list[tuple[Path, int]] = []
    found: list[tuple[Path, LauncherRecord]] = []
    try:
        for path in sorted(run_dir.glob(RECORD_GLOB)):
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:  # its launcher closed meanwhile
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a live launcher (another platform on this home, or this process)
                os.close(fd)
                continue
            held.append((path, fd))
            try:
                found.append((path, msgspec.json.decode(os.pread(fd, 1 << 20, 0), type=LauncherRecord)))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("launcher record %s of a dead launcher is unreadable (%s); removing it", path, exc)
        yield found
    finally:
        for path, fd in held:
            path.unlink(missing_ok=True)
            os.close(fd)


def terminate(ref: ProcessRef, what: str, timeout_s: float = 10.0) -> bool:
    """SIGTERM a process that is not our child (SIGKILL after `timeout_s`) and wait until it is gone; False if it was
    gone already. Its parent (init, or a subreaper) reaps it; a zombie counts as gone."""
    if not ref.alive():
        return False
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(ref.pid, sig)
        if wait_gone(ref, wait_s):
            return True
    log.warning("%s (pid %d) survived SIGKILL for 5 s", what, ref.pid)
    return True


def wait_gone(ref: ProcessRef, timeout_s: float) -> bool:
    """Poll until the process is gone (True) or `timeout_s` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while ref.alive():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def terminate_all(refs: list[ProcessRef], what: str, timeout_s: float = 10.0) -> int:
    """`terminate` for several processes at once (SIGTERM to all, then wait); returns how many were alive."""
    alive = [ref for ref in refs if ref.alive()]
    for ref in alive:
        log.info("stopping %s (pid %d) left by a dead launcher", what, ref.pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(ref.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for ref in alive:
        if not wait_gone(ref, max(0.0, deadline - time.monotonic())):
            terminate(ref, what, timeout_s=0.0)  # SIGKILL
    return len(alive)
