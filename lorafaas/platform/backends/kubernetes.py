"""Function instances as Kubernetes pods: the `Backend` the controller drives on a cluster.

Every call to the API server goes through `self.core` (a `CoreV1Api`; tests give a recording fake of it). One pod per
instance, built from the function pod template that the Helm chart ships in a ConfigMap:

    labels       app.kubernetes.io/{name,instance,component=function,managed-by}, lorafaas.io/{function,backbone}
    annotations  lorafaas.io/instance-id, lorafaas.io/worker-spec (the WorkerSpec as JSON: enough to adopt the pod)
    owner        the template ConfigMap, so `helm uninstall` garbage-collects every function pod
    affinity     required: a node whose node-agent pod is ready and serves the backbone (annotation
                 lorafaas.io/backbones on the agent pod), since the worker binds the daemon's segment on that node
    worker       `python -m lorafaas.function_runtime.worker <spec>` listening on tcp://0.0.0.0:PORT

`launch` creates the pod and waits until it is ready (or has failed: a failure is recorded, the pod deleted, and
InstanceUnavailable raised); `reconcile` makes the pods match a desired set after a controller restart (adopt, delete
orphans and failed pods, create missing), idempotently; `watch` records failures of running pods as they happen.
Failures are kept per function for `describe`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import re
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import yaml
from kubernetes import client as k8s
from kubernetes import watch as k8s_watch
from kubernetes.client.exceptions import ApiException

from lorafaas.backbone_daemon.config import DaemonPaths
from lorafaas.errors import DaemonUnavailable, InstanceUnavailable, InvalidInput
from lorafaas.function_runtime.client import WorkerClient
from lorafaas.function_runtime.messages import WorkerSpec
from lorafaas.platform.backends.pod_status import (
    ANNOTATION_BACKBONES,
    ANNOTATION_INSTANCE_ID,
    ANNOTATION_SPEC,
    LABEL_BACKBONE,
    LABEL_COMPONENT,
    LABEL_FUNCTION,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    PodFailure,
    is_ready,
    pending_reason,
    pod_failure,
)
from lorafaas.platform.model_store import ModelStore

log = logging.getLogger(__name__)

MAX_FAILURES_KEPT = 20  # per function
TEMPLATE_KEY = "pod.yaml"
WORKER_CONTAINER = "worker"


@dataclass(frozen=True)
class KubernetesConfig:
    namespace: str
    release: str  # the Helm release: every object of ours carries app.kubernetes.io/instance=<release>
    pod_template: str  # the ConfigMap holding the function pod template under `pod.yaml`
    home: Path = Path("/var/lib/lorafaas")  # LORAFAAS_HOME, the same path in the controller, agents and functions
    device: str = "cpu"
    worker_port: int = 9000
    poll_interval_s: float = 0.5
    delete_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 < self.worker_port < 65536:
            raise InvalidInput(f"worker port is {self.worker_port}; it must lie between 1 and 65535")
        if not 0.01 <= self.poll_interval_s <= 60:
            raise InvalidInput(f"poll interval is {self.poll_interval_s} s; it must lie between 0.01 s and 60 s")

    @classmethod
    def from_env(cls, home: Path, device: str = "cpu") -> KubernetesConfig:
        """In the controller pod: the chart sets these (the namespace from the downward API)."""
        missing = [k for k in ("POD_NAMESPACE", "LORAFAAS_RELEASE", "LORAFAAS_POD_TEMPLATE") if not os.environ.get(k)]
        if missing:
            raise InvalidInput(
                f"the Kubernetes backend needs {', '.join(missing)} in the environment (set by the chart)"
            )
        return cls(
            namespace=os.environ["POD_NAMESPACE"],
            release=os.environ["LORAFAAS_RELEASE"],
            pod_template=os.environ["LORAFAAS_POD_TEMPLATE"],
            home=Path(home),
            device=device,
            worker_port=int(os.environ.get("LORAFAAS_WORKER_PORT", "9000")),
        )

    @property
    def function_selector(self) -> str:
        return f"{LABEL_INSTANCE}={self.release},{LABEL_COMPONENT}=function"

    @property
    def agent_selector(self) -> str:
        return f"{LABEL_INSTANCE}={self.release},{LABEL_COMPONENT}=node-agent"


@dataclass
class PodInstance:
    """One function instance running in a pod (an `InstanceRef`)."""

    spec: WorkerSpec
    pod_name: str
    pod_ip: str
    backend: KubernetesBackend

    @property
    def pid(self) -> int | None:
        return None  # in the pod's own pid namespace: not ours to signal

    @property
    def address(self) -> str:
        return f"tcp://{self.pod_ip}:{self.backend.config.worker_port}"

    async def connect(self) -> WorkerClient:
        return await WorkerClient.connect(self.address, client="controller")

    def alive(self) -> bool:
        pod = self.backend.read_pod(self.pod_name)
        return pod is not None and pod.status is not None and pod.status.phase in ("Pending", "Running")

    def kill(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        self.backend.delete_pod(self.pod_name, grace_period_s=0 if sig == signal.SIGKILL else int(timeout_s))
        with contextlib.suppress(ValueError):
            self.backend.instances.remove(self)


@dataclass(frozen=True)
class ReconcileResult:
    adopted: tuple[str, ...] = ()  # instance ids
    created: tuple[str, ...] = ()
    deleted: tuple[str, ...] = ()  # pod names: orphans and failed pods


class KubernetesBackend:
    """Function pods for the node agent; the backbone daemons belong to the node-agent DaemonSet."""

    def __init__(
        self,
        config: KubernetesConfig,
        core: k8s.CoreV1Api | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.config = config
        self.core = core if core is not None else k8s.CoreV1Api(_load_client_config())
        self.clock = clock
        self.sleep = sleep
        self.store = ModelStore(config.home / "models")
        self.log_dir = config.home / "logs"  # workers log to their pod: `kubectl logs`; nothing is written here
        self.instances: list[PodInstance] = []
        self.failures: dict[str, list[PodFailure]] = {}
        self._serializer = k8s.ApiClient()  # only (de)serializes model objects; never sends a request
        self._template: k8s.V1Pod | None = None
        self._owner: k8s.V1OwnerReference | None = None
        self._lock = threading.Lock()

    # -- the library pool: none (every pod imports its libraries; the image's layers are the pre-load) ---------------

    @property
    def zygote_socket(self) -> Path:
        return self.config.home / "run" / "zygote.sock"

    @property
    def zygote_pid(self) -> int | None:
        return None

    def start_zygote(self) -> None:
        return None

    # -- backbone daemons (run by the node-agent DaemonSet) ----------------------------------------------------------

    def agent_nodes(self) -> dict[str, set[str]]:
        """node name -> the backbones its ready node-agent pod serves."""
        pods = self.core.list_namespaced_pod(self.config.namespace, label_selector=self.config.agent_selector)
        nodes: dict[str, set[str]] = {}
        for pod in pods.items:
            if pod.spec.node_name and is_ready(pod):
                served = (pod.metadata.annotations or {}).get(ANNOTATION_BACKBONES, "")
                nodes.setdefault(pod.spec.node_name, set()).update(b for b in served.split(",") if b)
        return nodes

    def backbone_nodes(self, backbone: str) -> list[str]:
        return sorted(node for node, served in self.agent_nodes().items() if backbone in served)

    def running_backbones(self) -> list[str]:
        return sorted(set().union(*self.agent_nodes().values()))

    def daemon_socket(self, backbone: str) -> Path:
        if not self.backbone_nodes(backbone):
            raise DaemonUnavailable(
                f"no ready node agent serves backbone {backbone!r}; add it to the chart's "
                "nodeAgent.backbones and check the node-agent pods"
            )
        return DaemonPaths.of(self.config.home, backbone, self.config.device).socket

    def stop_daemon(self, backbone: str) -> bool:
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
    ) -> WorkerSpec:
        return WorkerSpec(
            function=function,
            instance_id=f"{function}-{secrets.token_hex(3)}",
            deployment=deployment,
            socket_path=f"tcp://0.0.0.0:{self.config.worker_port}",
            model_dir=str(self.store.path(backbone)),
            adapter_dir=str(adapter_dir) if adapter_dir else None,
            daemon_socket=str(self.daemon_socket(backbone)) if shared else None,
            device=self.config.device,
            max_batch_size=max_batch_size,
            num_threads=num_threads,
        )

    def pod_name(self, spec: WorkerSpec) -> str:
        return _dns_subdomain(f"{self.config.release}-fn-{spec.instance_id}")

    def build_pod(self, spec: WorkerSpec, backbone: str, nodes: list[str]) -> k8s.V1Pod:
        """The pod for one instance: the template with our identity, command, port, probe and placement."""
        pod: k8s.V1Pod = copy.deepcopy(self.template())
        meta = pod.metadata or k8s.V1ObjectMeta()
        meta.name = self.pod_name(spec)
        meta.namespace = self.config.namespace
        meta.labels = {
            **(meta.labels or {}),
            LABEL_NAME: "lorafaas",
            LABEL_INSTANCE: self.config.release,
            LABEL_COMPONENT: "function",
            LABEL_MANAGED_BY: "lorafaas-controller",
            LABEL_FUNCTION: spec.function,
            LABEL_BACKBONE: backbone,
        }
        meta.annotations = {
            **(meta.annotations or {}),
            ANNOTATION_INSTANCE_ID: spec.instance_id,
            ANNOTATION_SPEC: msgspec.json.encode(spec).decode(),
        }
        meta.owner_references = [self.owner()]
        pod.metadata = meta
        pod.spec.restart_policy = "Never"  # the node agent restarts crashed instances itself
        worker = next((c for c in pod.spec.containers if c.name == WORKER_CONTAINER), None)
        if worker is None:
            raise InvalidInput(
                f"the function pod template in ConfigMap {self.config.pod_template} has no container "
                f"named {WORKER_CONTAINER!r}"
            )
        worker.command = ["python", "-m", "lorafaas.function_runtime.worker"]
        worker.args = [msgspec.json.encode(spec).decode()]
        worker.ports = [k8s.V1ContainerPort(name="worker", container_port=self.config.worker_port, protocol="TCP")]
        worker.readiness_probe = k8s.V1Probe(
            tcp_socket=k8s.V1TCPSocketAction(port="worker"), period_seconds=1, failure_threshold=3
        )
        affinity = pod.spec.affinity or k8s.V1Affinity()
        affinity.node_affinity = k8s.V1NodeAffinity(
            required_during_scheduling_ignored_during_execution=k8s.V1NodeSelector(
                node_selector_terms=[
                    k8s.V1NodeSelectorTerm(
                        match_fields=[
                            k8s.V1NodeSelectorRequirement(key="metadata.name", operator="In", values=list(nodes))
                        ]
                    )
                ]
            )
        )
        pod.spec.affinity = affinity
        return pod

    def launch(self, spec: WorkerSpec, *, fresh: bool = False, timeout_s: float = 120.0) -> PodInstance:
        """Create the instance's pod and return once its worker accepts connections."""
        backbone = self._backbone_of(spec)
        nodes = self.backbone_nodes(backbone)
        if not nodes:
            raise DaemonUnavailable(f"no ready node agent serves backbone {backbone!r}; cannot place {spec.function}")
        pod = self.build_pod(spec, backbone, nodes)
        self._call(f"creating pod {pod.metadata.name}", self.core.create_namespaced_pod, self.config.namespace, pod)
        log.info(
            "%s: created pod %s for instance %s on one of %s",
            spec.function,
            pod.metadata.name,
            spec.instance_id,
            ", ".join(nodes),
        )
        instance = self._wait_ready(spec, pod.metadata.name, timeout_s)
        self.instances.append(instance)
        return instance

    def _wait_ready(self, spec: WorkerSpec, name: str, timeout_s: float) -> PodInstance:
        deadline = self.clock() + timeout_s
        pod = None
        while self.clock() < deadline:
            pod = self.read_pod(name)
            if pod is None:
                raise InstanceUnavailable(f"{spec.function}: pod {name} was deleted while starting")
            failure = pod_failure(pod)
            if failure is not None:
                self._record(failure)
                self.delete_pod(name, grace_period_s=0)
                raise InstanceUnavailable(f"{spec.function}: pod {name} failed: {failure.reason}: {failure.message}")
            if is_ready(pod) and pod.status.pod_ip:
                return PodInstance(spec, name, pod.status.pod_ip, self)
            self.sleep(self.config.poll_interval_s)
        reason, message = pending_reason(pod)
        self._record(
            PodFailure(spec.function, spec.instance_id, name, reason, f"not ready after {timeout_s:.0f} s: {message}")
        )
        self.delete_pod(name, grace_period_s=0)
        raise InstanceUnavailable(
            f"{spec.function}: pod {name} not ready after {timeout_s:.0f} s ({reason}: {message})"
        )

    def read_pod(self, name: str) -> k8s.V1Pod | None:
        try:
            return self.core.read_namespaced_pod(name, self.config.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise InstanceUnavailable(f"reading pod {name} failed: {exc.status} {exc.reason}") from exc

    def delete_pod(self, name: str, grace_period_s: int = 30) -> bool:
        """Delete a pod; False if it was already gone."""
        try:
            self.core.delete_namespaced_pod(name, self.config.namespace, grace_period_seconds=grace_period_s)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise InstanceUnavailable(f"deleting pod {name} failed: {exc.status} {exc.reason}") from exc
        log.info("deleted pod %s", name)
        return True

    def list_function_pods(self) -> list[k8s.V1Pod]:
        return self._call(
            "listing function pods",
            self.core.list_namespaced_pod,
            self.config.namespace,
            label_selector=self.config.function_selector,
        ).items

    def reconcile(self, wanted: Iterable[WorkerSpec], timeout_s: float = 120.0) -> ReconcileResult:
        """Make the function pods match `wanted` (by instance id): adopt the healthy ones, delete failed pods and
        orphans (pods of no wanted instance), create the missing. Calling it again changes nothing."""
        wanted_by_id = {spec.instance_id: spec for spec in wanted}
        known = {instance.spec.instance_id for instance in self.instances}
        adopted, deleted, present = [], [], set()
        for pod in self.list_function_pods():
            instance_id = (pod.metadata.annotations or {}).get(ANNOTATION_INSTANCE_ID)
            failure = pod_failure(pod)
            if failure is not None:
                self._record(failure)
            if instance_id not in wanted_by_id or failure is not None or pod.metadata.deletion_timestamp:
                if not pod.metadata.deletion_timestamp and self.delete_pod(pod.metadata.name, grace_period_s=0):
                    deleted.append(pod.metadata.name)
                continue
            present.add(instance_id)
            if instance_id not in known and is_ready(pod) and pod.status.pod_ip:
                self.instances.append(
                    PodInstance(wanted_by_id[instance_id], pod.metadata.name, pod.status.pod_ip, self)
                )
                adopted.append(instance_id)
        created = []
        for instance_id, spec in wanted_by_id.items():
            if instance_id not in present:
                self.launch(spec, timeout_s=timeout_s)
                created.append(instance_id)
        self.instances = [i for i in self.instances if i.spec.instance_id in wanted_by_id]
        if adopted or created or deleted:
            log.info("reconciled function pods: adopted %s, created %s, deleted %s", adopted, created, deleted)
        return ReconcileResult(tuple(adopted), tuple(created), tuple(deleted))

    def adoptable_specs(self) -> list[WorkerSpec]:
        """The WorkerSpecs of the function pods that exist (from their annotation): what a restarted controller
        finds, to decide which to keep."""
        specs = []
        for pod in self.list_function_pods():
            raw = (pod.metadata.annotations or {}).get(ANNOTATION_SPEC)
            with contextlib.suppress(msgspec.ValidationError, msgspec.DecodeError, TypeError):
                specs.append(msgspec.json.decode(raw, type=WorkerSpec))
        return specs

    def watch(self, timeout_s: int = 60, stop: threading.Event | None = None) -> int:
        """Follow the function pods for `timeout_s` and record failures as they happen; returns how many."""
        watcher = k8s_watch.Watch()
        recorded = 0
        for event in watcher.stream(
            self.core.list_namespaced_pod,
            self.config.namespace,
            label_selector=self.config.function_selector,
            timeout_seconds=timeout_s,
        ):
            pod = event["object"]
            failure = pod_failure(pod) if event["type"] in ("ADDED", "MODIFIED") else None
            if failure is not None and self._record(failure):
                recorded += 1
            if stop is not None and stop.is_set():
                watcher.stop()
        return recorded

    def describe_failures(self, function: str) -> list[dict]:
        return [failure.describe() for failure in self.failures.get(function, [])]

    def close(self) -> None:
        for instance in list(self.instances):
            with contextlib.suppress(InstanceUnavailable):
                instance.kill(signal.SIGTERM, self.config.delete_timeout_s)
        self.instances.clear()

    # -- helpers -------------------------------------------------------------------------------------------------------

    def template(self) -> k8s.V1Pod:
        """The function pod template from its ConfigMap, read once."""
        if self._template is None:
            config_map = self._read_template_config_map()
            text = (config_map.data or {}).get(TEMPLATE_KEY)
            if not text:
                raise InvalidInput(f"ConfigMap {self.config.pod_template} has no {TEMPLATE_KEY}")
            self._template = self.pod_from_dict(yaml.safe_load(text))
        return self._template

    def owner(self) -> k8s.V1OwnerReference:
        if self._owner is None:
            config_map = self._read_template_config_map()
            self._owner = k8s.V1OwnerReference(
                api_version="v1",
                kind="ConfigMap",
                name=config_map.metadata.name,
                uid=config_map.metadata.uid,
                block_owner_deletion=False,
            )
        return self._owner

    def _read_template_config_map(self) -> k8s.V1ConfigMap:
        return self._call(
            f"reading ConfigMap {self.config.pod_template}",
            self.core.read_namespaced_config_map,
            self.config.pod_template,
            self.config.namespace,
        )

    def pod_from_dict(self, data: dict) -> k8s.V1Pod:
        return self._serializer.deserialize(json.dumps(data), "V1Pod", None)

    def to_dict(self, obj) -> dict:
        """A model object as the API server receives it (camelCase, no nulls)."""
        return self._serializer.sanitize_for_serialization(obj)

    def _record(self, failure: PodFailure) -> bool:
        with self._lock:
            kept = self.failures.setdefault(failure.function, [])
            if any(f.pod == failure.pod and f.reason == failure.reason for f in kept):
                return False
            kept.append(failure)
            del kept[:-MAX_FAILURES_KEPT]
        log.warning("%s: pod %s failed: %s: %s", failure.function, failure.pod, failure.reason, failure.message)
        return True

    def _backbone_of(self, spec: WorkerSpec) -> str:
        return Path(spec.model_dir).name

    @staticmethod
    def _call(what: str, method, *args, **kwargs):
        try:
            return method(*args, **kwargs)
        except ApiException as exc:
            raise InstanceUnavailable(f"{what} failed: {exc.status} {exc.reason}: {_api_message(exc)}") from exc


def _dns_subdomain(text: str) -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return name[:253].rstrip("-")


def _api_message(exc: ApiException) -> str:
    with contextlib.suppress(ValueError, TypeError):
        return json.loads(exc.body).get("message", "")
    return str(exc.body or "")


def _load_client_config() -> k8s.ApiClient:
    """In a pod: its service account; elsewhere: KUBECONFIG or ~/.kube/config."""
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return k8s.ApiClient()
