"""One function instance running in a pod (an `InstanceRef`), and what it needs of its backend (`PodHost`)."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from lorafaas.function_runtime.client import WorkerClient
from lorafaas.function_runtime.messages import WorkerSpec
from lorafaas.platform.backends.kubernetes_config import KubernetesConfig
from lorafaas.platform.backends.pod_cache import PodCache
from lorafaas.platform.backends.pod_status import pod_failure, pod_meta

T = TypeVar("T")


class PodHost(Protocol):
    """What a pod instance reads and calls of its backend (`KubernetesBackend` is one)."""

    config: KubernetesConfig
    cache: PodCache
    instances: list[PodInstance]

    def delete_pod(self, name: str, grace_period_s: int = 30) -> bool: ...

    async def run_api_call(self, call: Callable[..., T], *args: Any) -> T: ...


@dataclass
class PodInstance:
    """One function instance running in a pod (an `InstanceRef`)."""

    spec: WorkerSpec
    pod_name: str
    pod_ip: str
    backend: PodHost
    adopted: bool = False  # a previous controller's pod, claimed by this controller's launch

    @property
    def pid(self) -> int | None:
        return None  # in the pod's own pid namespace: not ours to signal

    @property
    def address(self) -> str:
        return f"tcp://{self.pod_ip}:{self.backend.config.worker_port}"

    async def connect(self) -> WorkerClient:
        return await WorkerClient.connect(self.address, client="controller")

    def alive(self) -> bool:
        pod = self.backend.cache.get(self.pod_name)
        return (pod is not None and pod_meta(pod).deletion_timestamp is None and pod.status is not None
                and pod.status.phase in ("Pending", "Running") and pod_failure(pod) is None)

    def kill(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        """Delete the pod (SIGKILL: no grace period) and return once it is gone (or timeout_s + 10 s passed)."""
        grace_s = 0 if sig == signal.SIGKILL else int(timeout_s)
        self.backend.delete_pod(self.pod_name, grace_period_s=grace_s)
        with contextlib.suppress(ValueError):
            self.backend.instances.remove(self)
        self.backend.cache.wait_for(self.pod_name, lambda pod: pod is None, grace_s + 10.0)

    async def kill_async(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        """`kill` holding no thread while the pod terminates (awaited from the watch)."""
        grace_s = 0 if sig == signal.SIGKILL else int(timeout_s)
        await self.backend.run_api_call(self.backend.delete_pod, self.pod_name, grace_s)
        with contextlib.suppress(ValueError):
            self.backend.instances.remove(self)
        await self.backend.cache.wait_until(self.pod_name, lambda pod: pod is None, grace_s + 10.0)
