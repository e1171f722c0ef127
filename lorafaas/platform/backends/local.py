"""Starting function workers as local processes: the backbone daemons (local_daemons.py: started on first use,
restarted when one dies, a stopped one's segment kept in the host tier), the zygote, its pool processes
(standby_pool.py) and the workers themselves. `LocalLauncher` owns every process it starts and stops them all on
`close()`; the node agent, the benchmarks and the tests drive function instances through it. A launcher may
drive several devices (the GPUs of a node): one daemon per (backbone, device), and each worker binds the daemon on
its own device. What it started is recorded in `$HOME/run` (local_record.py), so that the next launcher of a
platform killed with SIGKILL stops its zygote and instances and adopts its daemons (`recover_predecessors`).

    with LocalLauncher(home) as launcher:
        instance = launcher.launch("pirate", "smollm2-135m", adapter_dir)      # forked from the zygote
        async with await instance.connect() as worker: ...
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from lorafaas.config import LorafaasConfig
from lorafaas.errors import InvalidInput, LorafaasError, PlatformUnavailable
from lorafaas.formats.model_store import ModelStore
from lorafaas.function_runtime.client import WorkerClient
from lorafaas.function_runtime.messages import Assigned, WorkerSpec
from lorafaas.function_runtime.standby import assign
from lorafaas.function_runtime.zygote import (
    spawn_standby,
    spawn_worker,
    start_fresh_worker,
    start_zygote,
    wait_for_socket,
)
from lorafaas.platform.backends.host_tier import HostTier, default_host_tier_bytes
from lorafaas.platform.backends.local_daemons import DaemonProcess, LocalDaemons, private_dir
from lorafaas.platform.backends.local_record import (
    LauncherRecord,
    ProcessRef,
    RecordFile,
    daemon_key,
    dead_launchers,
    parse_daemon_key,
    terminate,
    terminate_all,
)
from lorafaas.platform.backends.standby_pool import StandbyPool, discard
from lorafaas.platform.descriptions import FailureView
from lorafaas.platform.devices import check_devices
from lorafaas.protocols.daemon_config import DaemonConfig

log = logging.getLogger(__name__)
def process_alive(process: subprocess.Popen | None, pid: int) -> bool:
    """Whether a process runs: polled if we started it (which also reaps it), else probed by pid."""
    if process is not None:
        return process.poll() is None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@dataclass
class InstanceHandle:
    spec: WorkerSpec
    pid: int
    log_path: Path
    process: subprocess.Popen | None  # set for fresh workers (our children); zygote children are the zygote's
    # a pool process given this function: how long its backbone attach and warm-up took, before (off the start)
    standby_s: float | None = None
    adopted = False  # every launch starts a process (a dead launcher's instances are stopped, not adopted)

    async def connect(self) -> WorkerClient:
        return await WorkerClient.connect(self.spec.socket_path, client="launcher")

    def alive(self) -> bool:
        return process_alive(self.process, self.pid)

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


class LocalLauncher:
    keeps_instances = False  # its workers stop with it (a dead launcher's are stopped by the next, not adopted)

    def __init__(self, home: Path, devices: tuple[str, ...] = ("cpu",), host_tier_bytes: int | None = None,
                 standby_workers: int = 0) -> None:
        """`standby_workers`: pre-forked pool processes kept per backbone and device (standby_pool.py); 0: none."""
        check_devices(devices)
        host_tier = HostTier(default_host_tier_bytes(psutil.virtual_memory().total) if host_tier_bytes is None
                             else host_tier_bytes)
        self.home = Path(home)
        self.devices = tuple(devices)
        self.store = ModelStore(LorafaasConfig(home=self.home).models_dir)
        self.run_dir = self.home / "run"
        self.log_dir = self.home / "logs"
        self._lock = threading.RLock()
        self._zygote: subprocess.Popen | None = None
        self.instances: list[InstanceHandle] = []
        self._record = RecordFile(self.run_dir)
        self._closing = threading.Event()
        self.daemons = LocalDaemons(self.store, self.log_dir, host_tier, self._lock, self._closing,
                                    on_change=self._write_record, on_gpu_daemon_death=self._stop_bound_instances)
        self.standbys = StandbyPool(standby_workers, self.run_dir, self._spawn_standby)

    def __enter__(self) -> LocalLauncher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def host_tier(self) -> HostTier:
        """Stopped CPU daemons' segments kept for the backbone's next daemon (the daemons' own)."""
        return self.daemons.host_tier

    @host_tier.setter
    def host_tier(self, tier: HostTier) -> None:
        self.daemons.host_tier = tier

    @property
    def device(self) -> str:
        """The first device: where an instance runs when no device is named."""
        return self.devices[0]

    def _device(self, device: str | None) -> str:
        if device is None:
            return self.devices[0]
        if device not in self.devices:
            raise InvalidInput(f"device {device} is not driven by this launcher ({', '.join(self.devices)})")
        return device

    @property
    def zygote_socket(self) -> Path:
        return self.run_dir / "zygote.sock"

    @property
    def zygote_pid(self) -> int | None:
        return self._zygote.pid if self._zygote is not None and self._zygote.poll() is None else None

    def daemon_socket(self, backbone: str, device: str | None = None) -> Path:
        """The socket of the backbone's daemon on `device` (None: the first), starting the daemon if needed."""
        config = DaemonConfig(home=self.home, backbone=backbone, device=self._device(device))
        with self._lock:  # callers on several threads must not start two daemons for one backbone
            return self.daemons.ensure(config)

    def _stop_bound_instances(self, config: DaemonConfig) -> None:
        """A GPU daemon's death is not survived by the instances bound to its memory: stop them (SIGKILL, they may
        be mid-kernel); the node agent sees them gone and starts new ones on the restarted daemon."""
        socket_path = str(config.paths.socket)
        for instance in [i for i in self.instances if i.spec.daemon_socket == socket_path]:
            log.warning("stopping instance %s (pid %d): its GPU backbone daemon died", instance.spec.instance_id,
                        instance.pid)
            instance.kill(signal.SIGKILL, timeout_s=5.0)
            self.instances.remove(instance)

    def running_backbones(self, device: str | None = None) -> list[str]:
        """Backbones whose daemon runs on `device` (None: the first; started here or found running)."""
        return self.daemons.running(self._device(device))

    def stop_daemon(self, backbone: str, device: str | None = None) -> bool:
        """Stop the backbone's daemon on `device` (None: the first) if this launcher started it (a CPU segment is kept
        in the host tier, within its budget; otherwise it goes with the daemon); False otherwise. Holds the lock until
        it is gone, so that nobody attaches to a daemon that is stopping."""
        with self._lock:
            return self.daemons.stop((backbone, self._device(device)))

    def recover_predecessors(self) -> None:
        """Clean up after launchers of this home that died without closing (a platform killed with SIGKILL): stop
        their function instances and zygote, adopt their backbone daemons (stopped by this launcher's close)."""
        if not self.run_dir.is_dir():
            return
        with self._lock, dead_launchers(self.run_dir) as records:
            for path, record in records:
                log.info(
                    "launcher %d of this home died without cleaning up (%s); recovering what it started",
                    record.launcher_pid,
                    path.name,
                )
                num_stopped = terminate_all(list(record.instances), "function instance")
                if record.zygote is not None and terminate(record.zygote, "library pool (zygote)"):
                    num_stopped += 1
                for name, ref in record.daemons.items():
                    if not ref.alive():
                        continue  # the next daemon started for it adopts its segment
                    key = parse_daemon_key(name, record.device)
                    daemon = DaemonProcess(DaemonConfig(home=self.home, backbone=key[0], device=key[1]), ref, None)
                    if key[1] not in self.devices or key in self.daemons.processes:
                        daemon.stop()
                        num_stopped += 1
                        continue
                    self.daemons.adopt(key, daemon)
                    log.info("adopted the backbone daemon %d of %s on %s", ref.pid, key[0], key[1])
                log.info(
                    "launcher %d: stopped %d process(es) it left; %d daemon(s) adopted",
                    record.launcher_pid,
                    num_stopped,
                    len(self.daemons.processes),
                )
            if records:
                self._write_record()
                if self.daemons.processes:
                    self.daemons.supervise()

    def _write_record(self) -> None:
        with self._lock:
            zygote = ProcessRef.of(self._zygote.pid) if self._zygote is not None else None
            instances = tuple(ref for i in list(self.instances) if (ref := ProcessRef.of(i.pid)).start_ticks)
            daemons = {daemon_key(*key): d.ref for key, d in self.daemons.processes.items()}
            if zygote is None and not instances and not daemons and not self._record.path.exists():
                return  # nothing started yet: no file
            private_dir(self.run_dir)
            self._record.write(
                LauncherRecord(
                    launcher_pid=os.getpid(), device=self.device, zygote=zygote, daemons=daemons, instances=instances
                )
            )

    def start_zygote(self) -> None:
        with self._lock:
            self._refuse_if_closing()
            self._start_zygote()

    def _refuse_if_closing(self) -> None:
        """After `close` began, nothing starts: a zygote or worker started then would outlive the launcher (a start
        racing the node agent's stop left an orphaned zygote behind)."""
        if self._closing.is_set():
            raise PlatformUnavailable("the node's launcher is closing; no instance starts")

    def _start_zygote(self) -> None:
        if self._zygote is None or self._zygote.poll() is not None:
            private_dir(self.run_dir)
            private_dir(self.log_dir)
            self._zygote = start_zygote(self.zygote_socket, self.log_dir / "zygote.log")
            self._write_record()

    def spec(
        self,
        function: str,
        backbone: str,
        adapter_dir: Path | None,
        *,
        shared: bool = True,
        max_batch_size: int = 8,
        num_threads: int | None = 1,
        deployment: str | None = None,
        device: str | None = None,
    ) -> WorkerSpec:
        """One intra-op thread by default: instances share the node's cores, and oversubscribed OpenMP threads
        spin-wait on each other (a forward pass ten times slower was measured with two threads on a busy 2-core
        machine). It runs on `device` (None: the first) and binds its backbone's daemon there."""
        device = self._device(device)
        instance_id = f"{function}-{secrets.token_hex(3)}"
        private_dir(self.run_dir)
        return WorkerSpec(
            function=function,
            instance_id=instance_id,
            deployment=deployment,
            socket_path=str(self.run_dir / f"{instance_id}.sock"),
            model_dir=str(self.store.path(backbone)),
            adapter_dir=str(adapter_dir) if adapter_dir else None,
            daemon_socket=str(self.daemon_socket(backbone, device)) if shared else None,
            device=device,
            max_batch_size=max_batch_size,
            num_threads=num_threads,
        )

    def launch(self, spec: WorkerSpec, *, fresh: bool = False, timeout_s: float = 120.0) -> InstanceHandle:
        """Start a worker for `spec`: forked from the zygote (libraries pre-loaded) or, if `fresh`, a new process."""
        log_path = instance_log_path(self.log_dir, spec)
        private_dir(self.log_dir)
        private_dir(log_path.parent)
        if fresh:
            with self._lock:
                self._refuse_if_closing()
            process = start_fresh_worker(spec, log_path)
            handle = InstanceHandle(spec, process.pid, log_path, process)
        else:
            self.start_zygote()
            assigned = self._assign_standby(spec, log_path)
            if assigned is None:
                handle = InstanceHandle(spec, spawn_worker(self.zygote_socket, spec, log_path), log_path, None)
            else:
                handle = InstanceHandle(spec, assigned.pid, log_path, None, standby_s=assigned.seconds)
        with self._lock:
            closing = self._closing.is_set()
            if not closing:
                self.instances.append(handle)
        if closing:  # `close` began while it started: it would not see this worker
            handle.kill()
            raise PlatformUnavailable("the node's launcher closed while an instance started; it was stopped")
        self._write_record()
        wait_for_socket(Path(spec.socket_path), timeout_s, handle.pid)
        return handle

    def _assign_standby(self, spec: WorkerSpec, log_path: Path) -> Assigned | None:
        """A pool process now serving `spec` (and the pool refilled behind it), or None: fork one."""
        standby = self.standbys.take(spec)
        self.standbys.refill(spec)
        if standby is None:
            return None
        try:
            return assign(Path(standby.spec.socket_path), spec, log_path)
        except (LorafaasError, OSError) as exc:  # never back into the pool: it may have half-taken the spec
            log.warning("%s: pool process %d refused its assignment (%s); forking a worker", spec.function,
                        standby.pid, exc)
            discard(standby)
            return None

    def fill_standbys(self, spec: WorkerSpec) -> None:
        """Start the pool processes for `spec`'s backbone now (a backbone made resident), not at its first start."""
        with self._lock:
            self._refuse_if_closing()
        self.start_zygote()
        self.standbys.refill(spec, delay_s=0.0)

    def _spawn_standby(self, spec: WorkerSpec) -> int:
        with self._lock:
            self._refuse_if_closing()
        private_dir(self.log_dir)
        return spawn_standby(self.zygote_socket, spec, self.log_dir / "standby.log")

    def describe_failures(self, function: str, since: float = 0.0) -> list[FailureView]:
        return []  # a local worker that fails is seen by the node agent itself (its process exits)

    def forget_failures(self, function: str) -> None:
        pass

    def adoptable(self) -> list[WorkerSpec]:
        return []

    def close(self) -> None:
        with self._lock:
            self._closing.set()  # nothing starts from now on, nor does the supervisor restart anything
            instances, self.instances = list(self.instances), []
        self.standbys.close()
        for instance in instances:
            instance.kill()
        if self._zygote is not None:
            self._zygote.terminate()
            try:
                self._zygote.wait(10)
            except subprocess.TimeoutExpired:
                self._zygote.kill()
                self._zygote.wait()
            self._zygote = None
        with self._lock:
            daemons = self.daemons.take_all()
        for daemon in daemons:  # a daemon that will not answer is killed; close() must not leave processes behind
            daemon.stop()
        self.host_tier.clear()
        with self._lock:
            self._record.remove()


DEPLOYMENT_LOGS_DIR = "functions"


def deployment_log_dir(log_dir: Path, deployment: str) -> Path:
    """Where the instances of one deployment (FunctionSpec.uid) log: a directory of its own, so reading a function's
    logs never matches another function's files, and deleting the function removes exactly its logs."""
    if not deployment or not deployment.isalnum():
        raise ValueError(f"deployment uid {deployment!r} is not alphanumeric")
    return Path(log_dir) / DEPLOYMENT_LOGS_DIR / deployment


def instance_log_path(log_dir: Path, spec: WorkerSpec) -> Path:
    if spec.deployment is None:  # a worker outside any deployment (benches, tests): the node's log directory
        return Path(log_dir) / f"{spec.instance_id}.log"
    return deployment_log_dir(log_dir, spec.deployment) / f"{spec.instance_id}.log"


def remove_deployment_logs(log_dir: Path, deployment: str) -> None:
    shutil.rmtree(deployment_log_dir(log_dir, deployment), ignore_errors=True)
