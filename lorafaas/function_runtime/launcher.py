"""Starting function workers as local processes: the backbone daemons, the zygote and the workers themselves.

`LocalLauncher` owns every process it starts and stops them all on `close()`; the node agent, the benchmarks and
the tests drive function instances through it.

    with LocalLauncher(home) as launcher:
        instance = launcher.launch("pirate", "smollm2-135m", adapter_dir)      # forked from the zygote
        async with await instance.connect() as worker: ...
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from lorafaas.backbone_daemon.client import spawn_daemon, stop_daemon, wait_until_ready
from lorafaas.backbone_daemon.config import DaemonConfig
from lorafaas.config import LorafaasConfig
from lorafaas.errors import DaemonUnavailable
from lorafaas.function_runtime.client import WorkerClient
from lorafaas.function_runtime.messages import WorkerSpec
from lorafaas.function_runtime.zygote import spawn_worker, start_fresh_worker, start_zygote, wait_for_socket
from lorafaas.platform.model_store import ModelStore

log = logging.getLogger(__name__)


@dataclass
class InstanceHandle:
    spec: WorkerSpec
    pid: int
    log_path: Path
    process: subprocess.Popen | None  # set for fresh workers (our children); zygote children are the zygote's

    async def connect(self) -> WorkerClient:
        return await WorkerClient.connect(self.spec.socket_path, client="launcher")

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def kill(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)
        deadline = time.monotonic() + timeout_s
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        if self.process is not None:
            self.process.wait()


def private_dir(path: Path) -> Path:
    """A directory only the platform's user can enter: sockets, logs (prompts at DEBUG) and lock files live there."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)  # also one made before this rule, or under a permissive umask
    return path


class LocalLauncher:
    def __init__(self, home: Path, device: str = "cpu") -> None:
        self.home = Path(home)
        self.device = device
        self.store = ModelStore(LorafaasConfig(home=self.home).models_dir)
        self.run_dir = self.home / "run"
        self.log_dir = self.home / "logs"
        self._daemons: dict[str, tuple[subprocess.Popen, Path]] = {}  # started (and stopped) by us
        self._borrowed: set[str] = set()  # backbones whose daemon was already running
        self._lock = threading.RLock()
        self._zygote: subprocess.Popen | None = None
        self.instances: list[InstanceHandle] = []

    def __enter__(self) -> LocalLauncher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def zygote_socket(self) -> Path:
        return self.run_dir / "zygote.sock"

    @property
    def zygote_pid(self) -> int | None:
        return self._zygote.pid if self._zygote is not None and self._zygote.poll() is None else None

    def daemon_socket(self, backbone: str) -> Path:
        """The socket of the backbone's daemon on this launcher's device, starting the daemon if needed."""
        config = DaemonConfig(home=self.home, backbone=backbone, device=self.device)
        with self._lock:  # callers on several threads must not start two daemons for one backbone
            return self._ensure_daemon(config)

    def _ensure_daemon(self, config: DaemonConfig) -> Path:
        backbone = config.backbone
        if backbone in self._daemons and self._daemons[backbone][0].poll() is None:
            return config.paths.socket
        if backbone in self._borrowed:  # someone else's daemon: it may have stopped since
            try:
                wait_until_ready(config.paths.socket, timeout_s=0.2)
                return config.paths.socket
            except DaemonUnavailable:
                self._borrowed.discard(backbone)
        try:  # a daemon someone else started (`lorafaas backbone serve`) is used, and left running
            wait_until_ready(config.paths.socket, timeout_s=0.2)
            self._borrowed.add(backbone)
        except DaemonUnavailable:
            private_dir(self.log_dir)
            with open(self.log_dir / f"daemon-{backbone}.log", "ab") as log_file:
                self._daemons[backbone] = (spawn_daemon(config, stderr=log_file), config.paths.socket)
        return config.paths.socket

    def running_backbones(self) -> list[str]:
        """Backbones whose daemon runs on this launcher's device (started here or found running)."""
        return [b for b, (process, _) in self._daemons.items() if process.poll() is None] + sorted(self._borrowed)

    def stop_daemon(self, backbone: str) -> bool:
        """Stop the backbone's daemon if this launcher started it (its segment goes with it); False otherwise.
        Holds the lock until it is gone, so that nobody attaches to a daemon that is stopping."""
        with self._lock:
            entry = self._daemons.pop(backbone, None)
            if entry is None:
                return False
            process, socket_path = entry
            try:
                stop_daemon(process, socket_path, force=True)
            except Exception:  # stopping must not fail the caller: kill it
                log.warning("backbone daemon %d did not stop cleanly; killing it", process.pid, exc_info=True)
                process.kill()
                process.wait()
        return True

    def start_zygote(self) -> None:
        with self._lock:
            self._start_zygote()

    def _start_zygote(self) -> None:
        if self._zygote is None or self._zygote.poll() is not None:
            private_dir(self.run_dir)
            private_dir(self.log_dir)
            self._zygote = start_zygote(self.zygote_socket, self.log_dir / "zygote.log")

    def spec(
        self, function: str, backbone: str, adapter_dir: Path | None, *, shared: bool = True,
        max_batch_size: int = 8, num_threads: int | None = 1,
    ) -> WorkerSpec:
        """One intra-op thread by default: instances share the node's cores, and oversubscribed OpenMP threads
        spin-wait on each other (a forward pass ten times slower was measured with two threads on a busy 2-core
        machine)."""
        instance_id = f"{function}-{secrets.token_hex(3)}"
        private_dir(self.run_dir)
        return WorkerSpec(
            function=function,
            instance_id=instance_id,
            socket_path=str(self.run_dir / f"{instance_id}.sock"),
            model_dir=str(self.store.path(backbone)),
            adapter_dir=str(adapter_dir) if adapter_dir else None,
            daemon_socket=str(self.daemon_socket(backbone)) if shared else None,
            device=self.device,
            max_batch_size=max_batch_size,
            num_threads=num_threads,
        )

    def launch(self, spec: WorkerSpec, *, fresh: bool = False, timeout_s: float = 120.0) -> InstanceHandle:
        """Start a worker for `spec`: forked from the zygote (libraries pre-loaded) or, if `fresh`, a new process."""
        private_dir(self.log_dir)
        log_path = self.log_dir / f"{spec.instance_id}.log"
        if fresh:
            process = start_fresh_worker(spec, log_path)
            handle = InstanceHandle(spec, process.pid, log_path, process)
        else:
            self.start_zygote()
            handle = InstanceHandle(spec, spawn_worker(self.zygote_socket, spec, log_path), log_path, None)
        self.instances.append(handle)
        wait_for_socket(Path(spec.socket_path), timeout_s, handle.pid)
        return handle

    def close(self) -> None:
        for instance in self.instances:
            instance.kill()
        self.instances.clear()
        if self._zygote is not None:
            self._zygote.terminate()
            try:
                self._zygote.wait(10)
            except subprocess.TimeoutExpired:
                self._zygote.kill()
                self._zygote.wait()
            self._zygote = None
        with self._lock:
            daemons = list(self._daemons.values())
            self._daemons.clear()
        for process, socket_path in daemons:
            try:
                stop_daemon(process, socket_path, force=True)
            except Exception:  # a daemon that will not answer is killed; close() must not leave processes behind
                log.warning("backbone daemon %d did not stop cleanly; killing it", process.pid, exc_info=True)
                process.kill()
                process.wait()
