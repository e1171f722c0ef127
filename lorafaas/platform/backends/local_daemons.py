"""The backbone daemons a `LocalLauncher` runs: one per (backbone, device), started on first use, restarted by a
supervisor thread when one dies, stopped with the launcher.

A restarted CPU daemon is handed a duplicate of its predecessor's sealed segment descriptor, so it adopts the segment
and its leases (attached instances notice nothing, nothing is loaded twice); a stopped one's segment is kept in the
host tier (host_tier.py) within its budget. On a GPU the instances bound to a dead daemon are stopped instead (the
launcher's `on_gpu_daemon_death`) and the daemon loads again. A daemon that fails to start (e.g. InsufficientMemory)
is not started again for that backbone before a backoff has passed; one that keeps dying is given up on. A daemon
someone else runs (`lorafaas backbone serve`) is used and left running.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lorafaas.errors import DaemonUnavailable, LorafaasError
from lorafaas.formats.model_store import ModelStore
from lorafaas.platform.backends.host_tier import HostTier, hand_back, keep_stopping_daemon
from lorafaas.platform.backends.local_record import ProcessRef, terminate, wait_gone
from lorafaas.protocols.daemon_client import DaemonClient, spawn_daemon, stop_daemon, wait_until_ready
from lorafaas.protocols.daemon_config import DaemonConfig

log = logging.getLogger(__name__)
SUPERVISE_INTERVAL_S = 0.25  # how soon a dead daemon is noticed
MAX_DAEMON_RESTARTS = 5  # per backbone within RESTART_WINDOW_S; then the supervisor gives up (a crash loop)
RESTART_WINDOW_S = 60.0
START_BACKOFF_S = (30.0, 600.0)  # after a failed start: first wait, doubling up to the second
DaemonKey = tuple[str, str]  # (backbone, device)


def private_dir(path: Path) -> Path:
    """A directory only the platform's user can enter: sockets, logs (prompts at DEBUG) and lock files live there."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)  # also one made before this rule, or under a permissive umask
    return path


def daemon_log_name(backbone: str, device: str) -> str:
    """`daemon-<backbone>.log` on the CPU, `daemon-<backbone>@cuda-N.log` on a GPU (one daemon per GPU)."""
    return f"daemon-{backbone}.log" if device == "cpu" else f"daemon-{backbone}@{device.replace(':', '-')}.log"


@dataclass
class DaemonProcess:
    """A backbone daemon the launcher stops on close: started by it (`process`), or adopted from a dead launcher."""

    config: DaemonConfig
    ref: ProcessRef
    process: subprocess.Popen | None  # None when adopted: not our child
    segment_fd: int | None = None  # a duplicate of its sealed segment, for a successor (cpu)

    def hold_segment(self) -> None:
        """Keep a duplicate of the daemon's sealed segment descriptor (cpu), to hand to a successor."""
        if self.config.device != "cpu" or self.segment_fd is not None:
            return
        try:
            with DaemonClient.connect(self.config.paths.socket) as client:
                _manifest, self.segment_fd = client.hold_segment()
        except LorafaasError as exc:
            log.warning("cannot hold the segment of backbone daemon %d (%s); a restart will load it again",
                        self.ref.pid, exc.message)

    def release_segment(self) -> None:
        if self.segment_fd is not None:
            os.close(self.segment_fd)
            self.segment_fd = None

    def alive(self) -> bool:
        return self.process.poll() is None if self.process is not None else self.ref.alive()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Shut it down (forced: its leases go with it) and wait; kill it if it does not answer or stop."""
        self.release_segment()
        socket_path = self.config.paths.socket
        if self.process is not None:
            try:
                stop_daemon(self.process, socket_path, force=True, timeout_s=timeout_s)
            except (LorafaasError, OSError):  # stopping must not fail the caller: kill it
                log.warning("backbone daemon %d did not stop cleanly; killing it", self.process.pid, exc_info=True)
                self.process.kill()
                self.process.wait()
            return
        if not self.ref.alive():
            return
        try:
            with DaemonClient.connect(socket_path) as client:
                client.shutdown(force=True)
        except LorafaasError as exc:
            log.warning(
                "adopted backbone daemon %d did not accept a shutdown (%s); terminating it", self.ref.pid, exc.message
            )
        if not wait_gone(self.ref, timeout_s):
            terminate(self.ref, f"backbone daemon of {self.config.backbone}")


class LocalDaemons:
    """The launcher's daemons. Every method but the supervisor's loop runs under the launcher's `lock` (held by the
    caller); `on_change` records what runs (the launcher's record file), `on_gpu_daemon_death` stops the instances
    bound to a GPU daemon that died."""

    def __init__(self, store: ModelStore, log_dir: Path, host_tier: HostTier, lock: threading.RLock,
                 closing: threading.Event, on_change: Callable[[], None],
                 on_gpu_daemon_death: Callable[[DaemonConfig], None]) -> None:
        self.store = store
        self.log_dir = log_dir
        self.host_tier = host_tier
        self.processes: dict[DaemonKey, DaemonProcess] = {}  # started (or adopted) and stopped by us
        self.borrowed: set[DaemonKey] = set()  # daemons someone else runs (`lorafaas backbone serve`)
        self.num_restarts: dict[DaemonKey, int] = {}
        self._lock = lock
        self._closing = closing
        self._on_change = on_change
        self._on_gpu_daemon_death = on_gpu_daemon_death
        self._restarted_at: dict[DaemonKey, list[float]] = {}
        self._start_failures: dict[DaemonKey, tuple[int, float, LorafaasError]] = {}  # -> (count, retry at, error)
        self._supervisor: threading.Thread | None = None

    def ensure(self, config: DaemonConfig) -> Path:
        """The socket of `config`'s daemon, started (or found running) if needed."""
        key = (config.backbone, config.device)
        daemon = self.processes.get(key)
        if daemon is not None:
            if not daemon.alive():  # died a moment ago; the supervisor has not seen it yet
                self._restart(key, daemon)
            if key not in self.processes:
                raise DaemonUnavailable(f"the backbone daemon of {config.backbone} on {config.device} keeps dying; "
                                        "see its log")
            return config.paths.socket
        if key in self.borrowed:  # someone else's daemon: it may have stopped since
            try:
                wait_until_ready(config.paths.socket, timeout_s=0.2)
                return config.paths.socket
            except DaemonUnavailable:
                self.borrowed.discard(key)
        try:  # a daemon someone else started (`lorafaas backbone serve`) is used, and left running
            wait_until_ready(config.paths.socket, timeout_s=0.2)
            self.borrowed.add(key)
        except DaemonUnavailable:
            needed = self.store.get(config.backbone).bytes if self.store.exists(config.backbone) else 0
            kept_fd = hand_back(self.host_tier, config, needed)
            try:
                self.processes[key] = self._spawn(config, adopt_fd=kept_fd)
            finally:
                if kept_fd is not None:
                    os.close(kept_fd)  # the daemon adopted its own (or refused it and loaded the store's)
            self._on_change()
            self.supervise()
        return config.paths.socket

    def running(self, device: str) -> list[str]:
        """Backbones whose daemon runs on `device` (started here or found running)."""
        return ([b for (b, d), daemon in self.processes.items() if d == device and daemon.alive()]
                + sorted(b for b, d in self.borrowed if d == device))

    def stop(self, key: DaemonKey) -> bool:
        """Stop the daemon of `key` if started here (a CPU segment is kept in the host tier, within its budget);
        False otherwise."""
        daemon = self.processes.pop(key, None)
        if daemon is None:
            return False
        if keep_stopping_daemon(self.host_tier, daemon.config, daemon.segment_fd):
            daemon.segment_fd = None  # the host tier's now
        daemon.stop()
        self._on_change()
        return True

    def adopt(self, key: DaemonKey, daemon: DaemonProcess) -> None:
        """A dead launcher's daemon, stopped by this launcher from now on."""
        self.processes[key] = daemon
        daemon.hold_segment()

    def take_all(self) -> list[DaemonProcess]:
        """Every daemon started or adopted here, forgotten: the caller stops them (the launcher closing)."""
        daemons = list(self.processes.values())
        self.processes.clear()
        return daemons

    def supervise(self) -> None:
        """Start the supervisor thread unless it runs."""
        if self._supervisor is None or not self._supervisor.is_alive():
            self._supervisor = threading.Thread(target=self._supervise, name="daemon-supervisor", daemon=True)
            self._supervisor.start()

    def _supervise(self) -> None:
        """Notice a daemon's death within SUPERVISE_INTERVAL_S and start it again."""
        while not self._closing.wait(SUPERVISE_INTERVAL_S):
            with self._lock:
                if self._closing.is_set():
                    return
                for key, daemon in list(self.processes.items()):
                    if not daemon.alive():
                        self._restart(key, daemon)

    def _spawn(self, config: DaemonConfig, adopt_fd: int | None = None) -> DaemonProcess:
        """Start a daemon (handing it a predecessor's segment if given) and hold its segment. A failed start is
        raised as the daemon reported it, once: the same error is raised again without starting anything until the
        backoff has passed (a node without the memory for a backbone is not asked again every few seconds)."""
        backbone, key = config.backbone, (config.backbone, config.device)
        failure = self._start_failures.get(key)
        if failure is not None and time.monotonic() < failure[1]:
            count, retry_at, error = failure
            raise type(error)(f"{error.message} (failed {count} time(s); next try in "
                              f"{retry_at - time.monotonic():.0f} s)")
        private_dir(self.log_dir)
        try:
            with open(self.log_dir / daemon_log_name(backbone, config.device), "ab") as log_file:
                process = spawn_daemon(config, stderr=log_file, adopt_fd=adopt_fd)
        except LorafaasError as exc:
            count = failure[0] + 1 if failure is not None else 1
            backoff_s = min(START_BACKOFF_S[0] * 2 ** (count - 1), START_BACKOFF_S[1])
            self._start_failures[key] = (count, time.monotonic() + backoff_s, exc)
            log.error("the backbone daemon of %s on %s failed to start (%s); not trying again for %.0f s",
                      backbone, config.device, exc.message, backoff_s)
            raise
        self._start_failures.pop(key, None)
        daemon = DaemonProcess(config, ProcessRef.of(process.pid), process)
        daemon.hold_segment()
        return daemon

    def _restart(self, key: DaemonKey, daemon: DaemonProcess) -> None:
        """Replace a daemon that died (the new one adopts its segment and leases); give up on a crash loop."""
        backbone = key[0]
        code = daemon.process.wait() if daemon.process is not None else None
        now = time.monotonic()
        recent = [t for t in self._restarted_at.get(key, []) if now - t < RESTART_WINDOW_S]
        if len(recent) >= MAX_DAEMON_RESTARTS:
            log.error("backbone daemon of %s died %d times within %.0f s; not restarting it again", backbone,
                      len(recent) + 1, RESTART_WINDOW_S)
            daemon.release_segment()
            del self.processes[key]
            self._on_change()
            return
        self._restarted_at[key] = [*recent, now]
        log.warning("backbone daemon %d of %s exited unexpectedly (code %s); restarting it", daemon.ref.pid, backbone,
                    code)
        if daemon.config.device != "cpu":
            self._on_gpu_daemon_death(daemon.config)
        try:
            self.processes[key] = self._spawn(daemon.config, adopt_fd=daemon.segment_fd)
        except (LorafaasError, OSError) as exc:
            log.error("restarting the backbone daemon of %s failed: %s", backbone, exc)
            del self.processes[key]
        else:
            self.num_restarts[key] = self.num_restarts.get(key, 0) + 1
            log.info("backbone daemon of %s restarted as pid %d", backbone, self.processes[key].ref.pid)
        finally:
            daemon.release_segment()  # the successor has its own duplicate (or loaded anew)
        self._on_change()
