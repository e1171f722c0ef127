"""Function instances as Kubernetes pods: the `Backend` the controller drives on a cluster.

Every call to the API server goes through `self.core` (a `CoreV1Api`). One watch (`PodCache`) follows the release's
function and node-agent pods, so that placement (`agent_nodes`, `running_backbones`), readiness and liveness are read
from memory: nothing the gateway does per invocation calls the API server. The calls that remain (create, delete,
read the template) block, and the node agent makes them from a worker thread (`asyncio.to_thread`).

`launch` creates the instance's pod (`function_pod.build_function_pod`) and waits until the watch sees it ready (or
failed: the failure is recorded, the pod deleted and InstanceUnavailable raised). The watch records failures of
running pods as they happen (OOMKilled, Evicted, deleted by a drain) for `describe`. After a controller restart,
`start()` finds the previous controller's healthy function pods and hands each to the first `launch` of the same
function, backbone and adapter (adoption), deleting those nobody claims within `adopt_window_s`; `reconcile(wanted)`
does the same for an explicit set of instances, idempotently.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import signal
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import yaml
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from lorafaas.errors import DaemonUnavailable, InstanceUnavailable, InvalidInput
from lorafaas.formats.model_store import ModelStore
from lorafaas.function_runtime.client import WorkerClient
from lorafaas.function_runtime.messages import WorkerSpec
from lorafaas.platform.backends.function_pod import build_function_pod, check_release, pod_name, template_owner
from lorafaas.platform.backends.pod_cache import PodCache
from lorafaas.platform.backends.pod_status import (
    ANNOTATION_BACKBONES,
    ANNOTATION_INSTANCE_ID,
    ANNOTATION_SPEC,
    LABEL_COMPONENT,
    LABEL_FUNCTION,
    LABEL_INSTANCE,
    PodFailure,
    is_ready,
    pending_reason,
    pod_failure,
    pod_ip,
    pod_meta,
    pod_name_of,
    pod_spec,
)
from lorafaas.protocols.daemon_config import DaemonPaths

log = logging.getLogger(__name__)

MAX_FAILURES_KEPT = 20  # per function
TEMPLATE_KEY = "pod.yaml"
NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True)
class KubernetesConfig:
    namespace: str
    release: str  # the Helm release: every object of ours carries app.kubernetes.io/instance=<release>
    pod_template: str  # the ConfigMap holding the function pod template under `pod.yaml`
    home: Path = Path("/var/lib/lorafaas")  # LORAFAAS_HOME, the same path in the controller, agents and functions
    device: str = "cpu"
    worker_port: int = 9000
    delete_timeout_s: float = 30.0
    adopt_window_s: float = 120.0  # after a restart: how long the previous controller's pods wait to be claimed
    listen_on_pod_ip: bool = False  # workers bind their pod IP, not 0.0.0.0 (pods sharing one network: tests)

    def __post_init__(self) -> None:
        if not 0 < self.worker_port < 65536:
            raise InvalidInput(f"worker port is {self.worker_port}; it must lie between 1 and 65535")
        if not (NAMESPACE.match(self.namespace) and len(self.namespace) <= 63):
            raise InvalidInput(f"namespace {self.namespace!r} is not a DNS label")
        check_release(self.release)
        if not 0 <= self.adopt_window_s <= 3600:
            raise InvalidInput(f"adopt window is {self.adopt_window_s} s; it must lie between 0 and 3600 s")

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
            listen_on_pod_ip=os.environ.get("LORAFAAS_WORKER_LISTEN", "any") == "pod-ip",
        )

    @property
    def watch_selector(self) -> str:
        """The pods the backend follows: its function pods and the node agents."""
        return f"{LABEL_INSTANCE}={self.release},{LABEL_COMPONENT} in (function,node-agent)"


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


@dataclass(frozen=True)
class ReconcileResult:
    adopted: tuple[str, ...] = ()  # instance ids
    created: tuple[str, ...] = ()
    deleted: tuple[str, ...] = ()  # pod names: orphans and failed pods


class KubernetesBackend:
    """Function pods for the node agent; the backbone daemons belong to the node-agent DaemonSet."""

    def __init__(self, config: KubernetesConfig, core: k8s.CoreV1Api | None = None) -> None:
        self.config = config
        self.core = core if core is not None else k8s.CoreV1Api(_load_client_config())
        self.store = ModelStore(config.home / "models")
        self.log_dir = config.home / "logs"  # workers log to their pod: `kubectl logs`; nothing is written here
        self.instances: list[PodInstance] = []
        self.failures: dict[str, list[PodFailure]] = {}
        self.cache = PodCache(self.core, config.namespace, config.watch_selector, on_change=self._observe)
        self._serializer = k8s.ApiClient()  # only (de)serializes model objects; never sends a request
        self._template: k8s.V1Pod | None = None
        self._owner: k8s.V1OwnerReference | None = None
        self._lock = threading.Lock()
        self._deleting: set[str] = set()  # pods we delete: their going is no failure
        self._adoptable: dict[str, k8s.V1Pod] = {}  # a previous controller's healthy pods, until claimed
        self._adopt_timer: threading.Timer | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------------------

    def start(self, timeout_s: float = 30.0) -> None:
        """Follow the pods, check the template with the API server, and take stock of the pods a previous controller
        left: healthy ones wait `adopt_window_s` to be claimed by a launch, failed ones are deleted."""
        if self.cache.started:
            return
        self.cache.start(timeout_s)
        self.check_template()
        known = {i.pod_name for i in self.instances}
        for pod in self.list_function_pods():
            name = pod_name_of(pod)
            if name in known or pod_meta(pod).deletion_timestamp is not None:
                continue
            if pod_failure(pod) is not None:
                self.delete_pod(name, grace_period_s=0)  # recorded by the watch
            else:
                self._adoptable[name] = pod
        if self._adoptable:
            log.info("found %d function pod(s) of a previous controller; adopting them as they are asked for "
                     "within %.0f s", len(self._adoptable), self.config.adopt_window_s)
            self._adopt_timer = threading.Timer(self.config.adopt_window_s, self.release_unclaimed)
            self._adopt_timer.daemon = True
            self._adopt_timer.start()

    def stop(self) -> None:
        """Stop following; the pods stay (a controller restart adopts them)."""
        if self._adopt_timer is not None:
            self._adopt_timer.cancel()
        self.cache.stop()

    def close(self) -> None:
        """Delete every pod this controller runs, then stop."""
        for instance in list(self.instances):
            with contextlib.suppress(InstanceUnavailable):
                instance.kill(signal.SIGTERM, self.config.delete_timeout_s)
        self.instances.clear()
        self.release_unclaimed()
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

    # -- backbone daemons (run by the node-agent DaemonSet) ----------------------------------------------------------

    def agent_nodes(self) -> dict[str, set[str]]:
        """node name -> the backbones its ready node-agent pod serves (from the watch: no API call)."""
        nodes: dict[str, set[str]] = {}
        for pod in self._started().pods():
            node = pod_spec(pod).node_name
            if ((pod_meta(pod).labels or {}).get(LABEL_COMPONENT) == "node-agent" and node
                    and pod_meta(pod).deletion_timestamp is None and is_ready(pod)):
                served = (pod_meta(pod).annotations or {}).get(ANNOTATION_BACKBONES, "")
                nodes.setdefault(node, set()).update(b for b in served.split(",") if b)
        return nodes

    def backbone_nodes(self, backbone: str) -> list[str]:
        return sorted(node for node, served in self.agent_nodes().items() if backbone in served)

    def running_backbones(self, device: str | None = None) -> list[str]:
        self._check_device(device)
        return sorted(set().union(*self.agent_nodes().values()))

    def daemon_socket(self, backbone: str, device: str | None = None) -> Path:
        self._check_device(device)
        if not self.backbone_nodes(backbone):
            raise DaemonUnavailable(
                f"no ready node agent serves backbone {backbone!r}; add it to the chart's "
                "nodeAgent.backbones and check the node-agent pods"
            )
        return DaemonPaths.of(self.config.home, backbone, self.config.device).socket

    def stop_daemon(self, backbone: str, device: str | None = None) -> bool:
        return False  # the DaemonSet owns the daemons: they are not the controller's to stop

    def _check_device(self, device: str | None) -> None:
        if device is not None and device != self.config.device:
            raise InvalidInput(f"device {device} is not this backend's; its pods run on {self.config.device}")

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
        self._check_device(device)
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
        return pod_name(self.config.release, spec.instance_id)

    def build_pod(self, spec: WorkerSpec, backbone: str, nodes: list[str]) -> k8s.V1Pod:
        return build_function_pod(self.template(), self.owner(), spec, namespace=self.config.namespace,
                                  release=self.config.release, backbone=backbone, nodes=nodes,
                                  worker_port=self.config.worker_port, home=str(self.config.home),
                                  listen_on_pod_ip=self.config.listen_on_pod_ip)

    def launch(self, spec: WorkerSpec, *, fresh: bool = False, timeout_s: float = 120.0) -> PodInstance:
        """A ready instance for `spec`: a previous controller's pod running the same thing, or a new pod (returns
        once its worker accepts connections)."""
        self._started()
        backbone = self._backbone_of(spec)
        adopted = self._claim(spec)
        if adopted is not None:
            return adopted
        nodes = self.backbone_nodes(backbone)
        if not nodes:
            raise DaemonUnavailable(f"no ready node agent serves backbone {backbone!r}; cannot place {spec.function}")
        pod = self.build_pod(spec, backbone, nodes)
        self._call(f"creating pod {pod_name_of(pod)}", self.core.create_namespaced_pod, self.config.namespace, pod)
        log.info("%s: created pod %s for instance %s on one of %s", spec.function, pod_name_of(pod),
                 spec.instance_id, ", ".join(nodes))
        instance = self._wait_ready(spec, pod_name_of(pod), timeout_s)
        self.instances.append(instance)
        return instance

    def _wait_ready(self, spec: WorkerSpec, name: str, timeout_s: float) -> PodInstance:
        seen = False

        def settled(pod: k8s.V1Pod | None) -> bool:
            nonlocal seen
            if pod is None:
                return seen  # gone after it was seen (before, the watch has not caught up yet)
            seen = True
            return (pod_meta(pod).deletion_timestamp is not None or pod_failure(pod) is not None
                    or (is_ready(pod) and bool(pod_ip(pod))))

        pod = self.cache.wait_for(name, settled, timeout_s)
        if pod is None and seen:
            raise InstanceUnavailable(f"{spec.function}: pod {name} was deleted while starting")
        if pod is not None and pod_meta(pod).deletion_timestamp is not None:
            raise InstanceUnavailable(f"{spec.function}: pod {name} is being deleted while starting")
        failure = pod_failure(pod) if pod is not None else None
        if failure is not None:
            self._record(failure)
            self.delete_pod(name, grace_period_s=0)
            raise InstanceUnavailable(f"{spec.function}: pod {name} failed: {failure.reason}: {failure.message}")
        if pod is not None and is_ready(pod) and (ip := pod_ip(pod)):
            return PodInstance(spec, name, ip, self)
        reason, message = pending_reason(pod)
        self._record(PodFailure(spec.function, spec.instance_id, name, reason,
                                f"not ready after {timeout_s:.0f} s: {message}"))
        self.delete_pod(name, grace_period_s=0)
        raise InstanceUnavailable(
            f"{spec.function}: pod {name} not ready after {timeout_s:.0f} s ({reason}: {message})")

    def read_pod(self, name: str) -> k8s.V1Pod | None:
        """The pod as the watch saw it last."""
        return self._started().get(name)

    def delete_pod(self, name: str, grace_period_s: int = 30) -> bool:
        """Ask for the pod's deletion (the kubelet confirms it after the grace period); False if it was gone."""
        with self._lock:
            self._deleting.add(name)
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

    def reconcile(self, wanted: Iterable[WorkerSpec], timeout_s: float = 120.0) -> ReconcileResult:
        """Make the function pods match `wanted` (by instance id): adopt the healthy ones, delete failed pods and
        orphans (pods of no wanted instance), create the missing. Calling it again changes nothing."""
        self._started()
        wanted_by_id = {spec.instance_id: spec for spec in wanted}
        known = {instance.spec.instance_id for instance in self.instances}
        adopted, deleted, present = [], [], set()
        for pod in self.list_function_pods():
            instance_id = (pod_meta(pod).annotations or {}).get(ANNOTATION_INSTANCE_ID)
            failure = pod_failure(pod)
            if instance_id not in wanted_by_id or failure is not None or pod_meta(pod).deletion_timestamp:
                if not pod_meta(pod).deletion_timestamp and self.delete_pod(pod_name_of(pod), grace_period_s=0):
                    deleted.append(pod_name_of(pod))
                continue
            present.add(instance_id)
            if instance_id not in known and is_ready(pod) and (ip := pod_ip(pod)):
                self.instances.append(
                    PodInstance(wanted_by_id[instance_id], pod_name_of(pod), ip, self)
                )
                adopted.append(instance_id)
            self._adoptable.pop(pod_name_of(pod), None)
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
        """The WorkerSpecs of the function pods that exist (from their annotation)."""
        specs = []
        for pod in self.list_function_pods():
            spec = _spec_of(pod)
            if spec is not None:
                specs.append(spec)
        return specs

    def release_unclaimed(self) -> list[str]:
        """Delete the previous controller's pods no launch claimed (functions deleted or scaled in meanwhile)."""
        with self._lock:
            unclaimed, self._adoptable = list(self._adoptable), {}
        for name in unclaimed:
            self.delete_pod(name, grace_period_s=int(self.config.delete_timeout_s))
        if unclaimed:
            log.info("deleted %d function pod(s) of a previous controller that no function claimed", len(unclaimed))
        return unclaimed

    def _claim(self, spec: WorkerSpec) -> PodInstance | None:
        """A previous controller's healthy pod running exactly `spec` but for the instance id."""
        with self._lock:
            for name in list(self._adoptable):
                pod = self.cache.get(name)
                theirs = _spec_of(pod) if pod is not None else None
                if (pod is None or theirs is None or pod_failure(pod) is not None
                        or pod_meta(pod).deletion_timestamp is not None):
                    del self._adoptable[name]
                    continue
                if (msgspec.structs.replace(theirs, instance_id=spec.instance_id) == spec and is_ready(pod)
                        and (ip := pod_ip(pod))):
                    del self._adoptable[name]
                    instance = PodInstance(theirs, name, ip, self)
                    self.instances.append(instance)
                    log.info("%s: adopted pod %s (instance %s) of a previous controller", spec.function, name,
                             theirs.instance_id)
                    return instance
        return None

    def describe_failures(self, function: str, since: float = 0.0) -> list[dict]:
        with self._lock:
            return [failure.describe() for failure in self.failures.get(function, []) if failure.at >= since]

    def forget_failures(self, function: str) -> None:
        with self._lock:
            self.failures.pop(function, None)

    # -- the template ------------------------------------------------------------------------------------------------

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
            self._owner = template_owner(self._read_template_config_map())
        return self._owner

    def check_template(self) -> None:
        """Ask the API server whether a pod from the template is valid (a dry run: nothing is created), so that a
        template it refuses (e.g. a memory request above its limit) stops the controller at start with the server's
        reason instead of failing every launch."""
        probe = WorkerSpec(function="template-check", instance_id="template-check-0",
                           socket_path=f"tcp://0.0.0.0:{self.config.worker_port}",
                           model_dir=str(self.config.home / "models" / "template-check"))
        pod = self.build_pod(probe, "template-check", ["template-check"])
        try:
            self.core.create_namespaced_pod(self.config.namespace, pod, dry_run="All")
        except ApiException as exc:
            if exc.status in (400, 422):
                raise InvalidInput(
                    f"the function pod template (ConfigMap {self.config.pod_template}, from the chart's function.* "
                    f"values) is refused by the API server: {_api_message(exc)}"
                ) from exc
            raise InstanceUnavailable(f"checking the function pod template failed: {exc.status} {exc.reason}: "
                                      f"{_api_message(exc)}") from exc

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

    # -- what the watch sees -------------------------------------------------------------------------------------------

    def _observe(self, pod: k8s.V1Pod, deleted: bool) -> None:
        """In the watch thread: record function pods that failed, or went without our asking (a drain, an
        eviction, a node removed); the node agent sees their workers' connections close and starts replacements."""
        labels = pod_meta(pod).labels or {}
        if labels.get(LABEL_COMPONENT) != "function":
            return
        name = pod_name_of(pod)
        failure = pod_failure(pod)
        if failure is not None:
            self._record(failure)
        if deleted:
            with self._lock:
                ours = name in self._deleting
                self._deleting.discard(name)
                self._adoptable.pop(name, None)
                gone = [i for i in self.instances if i.pod_name == name]
                for instance in gone:
                    self.instances.remove(instance)
            if not ours and failure is None:
                self._record(PodFailure(
                    labels.get(LABEL_FUNCTION, "?"),
                    (pod_meta(pod).annotations or {}).get(ANNOTATION_INSTANCE_ID, name),
                    name, "Deleted", "the pod was deleted by someone else (kubectl drain or delete, an eviction, its "
                    "node removed); a replacement starts on the next request or reconcile"))

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


def _spec_of(pod: k8s.V1Pod) -> WorkerSpec | None:
    raw = (pod_meta(pod).annotations or {}).get(ANNOTATION_SPEC)
    if raw is None:
        return None
    with contextlib.suppress(msgspec.ValidationError, msgspec.DecodeError, TypeError):
        return msgspec.json.decode(raw, type=WorkerSpec)
    return None


def _api_message(exc: ApiException) -> str:
    if exc.body is None:
        return ""
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        return json.loads(exc.body).get("message", "")
    return str(exc.body)


def _load_client_config() -> k8s.ApiClient:
    """In a pod: its service account; elsewhere: KUBECONFIG or ~/.kube/config."""
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return k8s.ApiClient()
