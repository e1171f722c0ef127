"""Function instances as Kubernetes pods: the `Backend` the controller drives on a cluster.

Every call to the API server goes through `self.core` (a `CoreV1Api`). One watch (`PodCache`) follows the release's
function and node-agent pods, so that placement (`agent_nodes`, `running_backbones`), readiness and liveness are read
from memory: nothing the gateway does per invocation calls the API server. The calls that remain (create, delete,
read the template) block; from the event loop they run on the backend's own few threads (`API_THREADS`), never on the
default executor that the gateway's store calls use.

`launch` creates the instance's pod (`function_pod.build_function_pod`) and waits until the watch sees it ready (or
failed: the failure is recorded, the pod deleted and InstanceUnavailable raised). The node agent calls `launch_async`
and `PodInstance.kill_async`, which await the watch instead of blocking a thread: a pod that waits two minutes for a
node holds no thread, so any number of them leave the request path's threads alone. The watch records failures of
running pods as they happen (OOMKilled, Evicted, deleted by a drain) for `describe`. After a controller restart,
`start()` finds the previous controller's healthy function pods and hands each to the first `launch` of the same
function, backbone and adapter (adoption), deleting those nobody claims within `adopt_window_s`;
`adoption.reconcile(wanted)` does the same for an explicit set of instances, idempotently.

The backend delegates to its collaborators, one module each: `pod_template` (the template, its owner, the dry-run
check), `failures` (what the watch recorded: pod_failures.py), `adoption` (pod_adoption.py), `agents` (the node
agents and the backbones they serve: node_agents.py); `PodInstance` is pod_instance.py, `KubernetesConfig`
kubernetes_config.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from lorafaas.errors import DaemonUnavailable, InstanceUnavailable
from lorafaas.formats.model_store import ModelStore
from lorafaas.function_runtime.messages import WorkerSpec
from lorafaas.platform.adapter_access import AdapterAccess
from lorafaas.platform.backends.function_pod import pod_name
from lorafaas.platform.backends.kubernetes_config import KubernetesConfig, api_call, load_client_config
from lorafaas.platform.backends.node_agents import NodeAgents
from lorafaas.platform.backends.pod_adoption import PodAdoption, ReconcileResult
from lorafaas.platform.backends.pod_cache import PodCache
from lorafaas.platform.backends.pod_failures import PodFailures
from lorafaas.platform.backends.pod_instance import PodInstance
from lorafaas.platform.backends.pod_status import (
    LABEL_COMPONENT,
    PodFailure,
    is_ready,
    pending_reason,
    pod_failure,
    pod_ip,
    pod_meta,
    pod_name_of,
    pod_spec,
)
from lorafaas.platform.backends.pod_template import PodTemplate
from lorafaas.platform.descriptions import FailureView
from lorafaas.platform.thread_pools import started_pool

__all__ = ["KubernetesBackend", "KubernetesConfig", "PodInstance", "ReconcileResult"]

log = logging.getLogger(__name__)

API_THREADS = 4  # the backend's own threads for the API calls the event loop makes (create, delete: each brief)
T = TypeVar("T")


class KubernetesBackend:
    """Function pods for the node agent; the backbone daemons belong to the node-agent DaemonSet."""

    keeps_instances = True  # pods outlive the controller: see close()

    def __init__(self, config: KubernetesConfig, core: k8s.CoreV1Api | None = None,
                 adapter_access: AdapterAccess | None = None) -> None:
        self.config = config
        self.core = core if core is not None else k8s.CoreV1Api(load_client_config())
        self.store = ModelStore(config.home / "models")
        self.log_dir = config.home / "logs"  # workers log to their pod: `kubectl logs`; nothing is written here
        self.instances: list[PodInstance] = []
        self._lock = threading.Lock()  # `instances` against the watch thread's removals
        self.failures = PodFailures(on_gone=self._gone)
        self.cache = PodCache(self.core, config.namespace, config.watch_selector, on_change=self.failures.observe,
                              watch_timeout_s=config.watch_timeout_s)
        # the tokens pods fetch their adapter with (the gateway's adapter route checks them with the same access)
        self.adapter_access = adapter_access or AdapterAccess.from_admin_key(None)
        self.pod_template = PodTemplate(config, self.core, self.adapter_access)
        self.adoption = PodAdoption(self)
        self.agents = NodeAgents(config, lambda: self._started().pods())
        self._api_threads = started_pool(API_THREADS, "k8s-api")  # a coroutine never waits for a thread to start

    # -- lifecycle ---------------------------------------------------------------------------------------------------

    def start(self, timeout_s: float = 30.0) -> None:
        """Follow the pods, check the template with the API server, and take stock of the pods a previous controller
        left: healthy ones wait `adopt_window_s` to be claimed by a launch, failed ones are deleted."""
        if self.cache.started:
            return
        self.cache.start(timeout_s)
        self.agents.start()
        self.pod_template.check()
        self.adoption.take_stock()

    def stop(self) -> None:
        """Stop following; the pods stay (a controller restart adopts them)."""
        self.adoption.cancel()
        self.agents.stop()
        self.cache.stop()
        self._api_threads.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Stop following and leave the pods running: a controller stops for an upgrade, a move or a restart, and the
        next one adopts them. `helm uninstall` deletes them through their owner (the template ConfigMap)."""
        self.instances.clear()
        self.stop()

    def adoptable(self) -> list[WorkerSpec]:
        self._started()
        return self.adoption.waiting()

    def delete_instances(self) -> None:
        """Delete every pod this controller runs, then stop."""
        for instance in list(self.instances):
            with contextlib.suppress(InstanceUnavailable):
                instance.kill(signal.SIGTERM, self.config.delete_timeout_s)
        self.instances.clear()
        self.adoption.release_unclaimed()
        self.stop()

    def _started(self) -> PodCache:
        if not self.cache.started:
            self.start()
        return self.cache

    # -- the library pool: none (every pod imports its libraries; the image's layers are the pre-load) ---------------

    @property
    def zygote_socket(self) -> Path:
        return self.config.home / "run" / "zygote.sock"

    @property
    def zygote_pid(self) -> int | None:
        return None

    def start_zygote(self) -> None:
        return None

    # -- backbone daemons (run by the node-agent DaemonSet: `agents`) -----------------------------------------------

    def running_backbones(self, device: str | None = None) -> list[str]:
        self.agents.check_device(device)
        return self.agents.backbones()

    def daemon_socket(self, backbone: str, device: str | None = None) -> Path:
        self.agents.check_device(device)
        return self.agents.daemon_socket(backbone, device)

    def stop_daemon(self, backbone: str, device: str | None = None) -> bool:
        return False  # the DaemonSet owns the daemons: they are not the controller's to stop

    # -- function pods -------------------------------------------------------------------------------------------------

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
        self.agents.check_device(device)
        return WorkerSpec(
            function=function,
            instance_id=f"{function}-{secrets.token_hex(3)}",
            deployment=deployment,
            socket_path=f"tcp://0.0.0.0:{self.config.worker_port}",
            model_dir=str(self.store.path(backbone)),
            adapter_dir=str(adapter_dir) if adapter_dir else None,
            daemon_socket=str(self.daemon_socket(backbone, device)) if shared else None,
            device=device or self.config.device,
            max_batch_size=max_batch_size,
            num_threads=num_threads,
        )

    def pod_name(self, spec: WorkerSpec) -> str:
        return pod_name(self.config.release, spec.instance_id)

    def launch(self, spec: WorkerSpec, *, fresh: bool = False, timeout_s: float = 120.0) -> PodInstance:
        """A ready instance for `spec`: a previous controller's pod running the same thing, or a new pod (returns
        once its worker accepts connections)."""
        placed = self._place(spec)
        if isinstance(placed, PodInstance):
            return placed
        settled = PodSettled(self.agents.lost)
        pod = self.cache.wait_for(placed, settled, timeout_s)
        return self._verdict(spec, placed, pod, settled.seen, timeout_s)

    async def launch_async(self, spec: WorkerSpec, *, fresh: bool = False, timeout_s: float = 120.0) -> PodInstance:
        """`launch` holding no thread while the pod starts: its API calls run on the backend's own threads, and its
        readiness is awaited from the watch."""
        placed = await self.run_api_call(self._place, spec)
        if isinstance(placed, PodInstance):
            return placed
        settled = PodSettled(self.agents.lost)
        try:
            pod = await self.cache.wait_until(placed, settled, timeout_s)
        except asyncio.CancelledError:  # the agent is stopping: a pod that never served is not left behind
            with contextlib.suppress(InstanceUnavailable, RuntimeError):  # RuntimeError: the backend stopped first
                await asyncio.shield(self.run_api_call(self.delete_pod, placed, 0))
            raise
        return await self.run_api_call(self._verdict, spec, placed, pod, settled.seen, timeout_s)

    async def run_api_call(self, call: Callable[..., T], *args: Any) -> T:
        """`call(*args)` (blocking on the API server) on the backend's own threads."""
        return await asyncio.get_running_loop().run_in_executor(self._api_threads, functools.partial(call, *args))

    def _place(self, spec: WorkerSpec) -> PodInstance | str:
        """An adopted instance for `spec`, or the name of the pod created for it."""
        self._started()
        backbone = Path(spec.model_dir).name
        adopted = self.adoption.claim(spec)
        if adopted is not None:
            return adopted
        nodes = self.agents.backbone_nodes(backbone)
        if not nodes:
            raise DaemonUnavailable(f"no ready node agent serves backbone {backbone!r}; cannot place {spec.function}")
        pod = self.pod_template.build_pod(spec, backbone, nodes)
        api_call(f"creating pod {pod_name_of(pod)}", self.core.create_namespaced_pod, self.config.namespace, pod)
        log.info("%s: created pod %s for instance %s on one of %s", spec.function, pod_name_of(pod),
                 spec.instance_id, ", ".join(nodes))
        return pod_name_of(pod)

    def _verdict(self, spec: WorkerSpec, name: str, pod: k8s.V1Pod | None, seen: bool,
                 timeout_s: float) -> PodInstance:
        """The instance once its pod settled ready; else its failure recorded, the pod deleted, InstanceUnavailable."""
        if pod is None and seen:
            raise InstanceUnavailable(f"{spec.function}: pod {name} was deleted while starting")
        if pod is not None and pod_meta(pod).deletion_timestamp is not None:
            raise InstanceUnavailable(f"{spec.function}: pod {name} is being deleted while starting")
        failure = pod_failure(pod) if pod is not None else None
        if failure is not None:
            self.failures.record(failure)
            self.delete_pod(name, grace_period_s=0)
            raise InstanceUnavailable(f"{spec.function}: pod {name} failed: {failure.reason}: {failure.message}")
        if pod is not None and is_ready(pod) and (ip := pod_ip(pod)):
            instance = PodInstance(spec, name, ip, self)
            self.instances.append(instance)
            return instance
        if pod is not None and self.agents.lost(node := pod_spec(pod).node_name):  # its machine is gone: not waited
            self.failures.record(PodFailure(spec.function, spec.instance_id, name, "NodeLost",
                                            f"the node agent on {node} stopped answering"))
            self.delete_pod(name, grace_period_s=0)
            raise InstanceUnavailable(f"{spec.function}: pod {name} was placed on {node}, whose node agent stopped "
                                      "answering")
        reason, message = pending_reason(pod)
        self.failures.record(PodFailure(spec.function, spec.instance_id, name, reason,
                                        f"not ready after {timeout_s:.0f} s: {message}"))
        self.delete_pod(name, grace_period_s=0)
        raise InstanceUnavailable(
            f"{spec.function}: pod {name} not ready after {timeout_s:.0f} s ({reason}: {message})")

    def read_pod(self, name: str) -> k8s.V1Pod | None:
        """The pod as the watch saw it last."""
        return self._started().get(name)

    def delete_pod(self, name: str, grace_period_s: int = 30) -> bool:
        """Ask for the pod's deletion (the kubelet confirms it after the grace period); False if it was gone."""
        self.failures.expect_deletion(name)
        try:
            self.core.delete_namespaced_pod(name, self.config.namespace, grace_period_seconds=grace_period_s)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise InstanceUnavailable(f"deleting pod {name} failed: {exc.status} {exc.reason}") from exc
        log.info("deleting pod %s (grace %d s)", name, grace_period_s)
        return True

    def list_function_pods(self) -> list[k8s.V1Pod]:
        return [p for p in self._started().pods() if (pod_meta(p).labels or {}).get(LABEL_COMPONENT) == "function"]

    def describe_failures(self, function: str, since: float = 0.0) -> list[FailureView]:
        return self.failures.describe(function, since)

    def forget_failures(self, function: str) -> None:
        self.failures.forget(function)

    def _gone(self, name: str) -> None:
        """In the watch thread: a function pod was deleted (by us or not): its instance is no more."""
        self.adoption.drop(name)
        with self._lock:
            for instance in [i for i in self.instances if i.pod_name == name]:
                self.instances.remove(instance)


class PodSettled:
    """Whether a starting pod has settled (ready with an address, failed, being deleted, bound to a node whose agent
    is `lost`, or gone after it was seen): what a launch waits for; `seen` tells a pod that is gone from one the watch
    has not caught up with yet."""

    def __init__(self, lost: Callable[[str | None], bool]) -> None:
        self.lost = lost
        self.seen = False

    def __call__(self, pod: k8s.V1Pod | None) -> bool:
        if pod is None:
            return self.seen
        self.seen = True
        return (pod_meta(pod).deletion_timestamp is not None or pod_failure(pod) is not None
                or (is_ready(pod) and bool(pod_ip(pod))) or self.lost(pod_spec(pod).node_name))
