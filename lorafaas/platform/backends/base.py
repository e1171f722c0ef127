"""The operations the node agent needs from wherever its function instances run.

`LocalLauncher` (processes on this machine) satisfies it as it is; `KubernetesBackend` (one pod per instance) does
too. The node agent types against `Backend`, never against one implementation. A backend may run instances on
several devices (`LocalLauncher`: every GPU of the node); `device=None` means its first one.

    spec = backend.spec("pirate", "smollm2-135m", adapter_dir)    # a WorkerSpec: where it listens, what it binds
    instance = backend.launch(spec)                               # returns once the worker accepts connections
    async with await instance.connect() as worker: ...
    instance.kill()                                               # stop it (SIGTERM, then SIGKILL / pod deletion)
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Protocol, runtime_checkable

from lorafaas.formats.model_store import ModelStore
from lorafaas.function_runtime.client import WorkerClient
from lorafaas.function_runtime.messages import WorkerSpec
from lorafaas.platform.descriptions import FailureView


@runtime_checkable
class InstanceRef(Protocol):
    """One running function instance, as `Backend.launch` returns it."""

    spec: WorkerSpec

    @property
    def pid(self) -> int | None: ...  # a local process id; None where it is not ours to see (a pod)

    async def connect(self) -> WorkerClient: ...

    @property
    def adopted(self) -> bool: ...  # found running, left by a previous controller (not started for this launch)

    def alive(self) -> bool: ...

    def kill(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None: ...


@runtime_checkable
class Backend(Protocol):
    store: ModelStore  # backbones: their config and sizes, read by the node agent's scheduler
    instances: list  # the InstanceRefs launched and not yet stopped
    log_dir: Path  # the platform's logs (per deployment, billing); on Kubernetes workers log to their pods instead
    # True where instances outlive the controller (pods): stopping leaves them running and `close()` does not stop
    # them; the next controller finds them in `adoptable()` and its launches of the same specs adopt them
    keeps_instances: bool

    # -- function instances ----------------------------------------------------------------------------------------

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
        device: str | None = None,  # where it runs, binding the daemon of its backbone there
    ) -> WorkerSpec: ...

    def launch(self, spec: WorkerSpec, *, fresh: bool = False, timeout_s: float = 120.0) -> InstanceRef: ...

    def close(self) -> None: ...  # stop every instance (and daemon) this backend started, unless keeps_instances

    def adoptable(self) -> list[WorkerSpec]: ...  # what a previous controller left running, waiting to be claimed

    # what the backend saw of a function's instances that did not run (a pod that could not be scheduled, pull its
    # image or stay alive), recorded at `since` (unix time) or later; forgotten when the function is deleted
    def describe_failures(self, function: str, since: float = 0.0) -> list[FailureView]: ...

    def forget_failures(self, function: str) -> None: ...

    # -- backbone daemons ------------------------------------------------------------------------------------------

    def running_backbones(self, device: str | None = None) -> list[str]: ...  # those with a daemon on `device`

    def daemon_socket(self, backbone: str, device: str | None = None) -> Path: ...  # where workers attach; may
    # start the daemon

    def stop_daemon(self, backbone: str, device: str | None = None) -> bool: ...  # False: not ours to stop

    # -- the library pool: a warm process workers fork from; a backend without one reports zygote_pid None --------

    @property
    def zygote_socket(self) -> Path: ...

    @property
    def zygote_pid(self) -> int | None: ...

    def start_zygote(self) -> None: ...


# A backend whose instances take long to start or stop (a pod waits for a node, then for its image) waits for them
# without a thread: the node agent awaits these where a backend has them, instead of running `launch` and `kill` on
# the default executor, whose few threads the gateway's store calls need.


@runtime_checkable
class AsyncLauncher(Protocol):
    async def launch_async(self, spec: WorkerSpec, *, fresh: bool = False,
                           timeout_s: float = 120.0) -> InstanceRef: ...


@runtime_checkable
class AsyncKillable(Protocol):
    async def kill_async(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None: ...


@runtime_checkable
class StandbyLauncher(Protocol):
    """A backend keeping pre-forked processes per backbone (the local one): filled when a backbone becomes resident."""

    def fill_standbys(self, spec: WorkerSpec) -> None: ...
