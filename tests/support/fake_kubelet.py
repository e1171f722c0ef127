"""A kubelet for test clusters: the node side of the real control plane in `tests.support.k8s_cluster`.

It registers its Nodes (capacity, Ready, an InternalIP on loopback), renews their Leases in kube-node-lease so the
node lifecycle controller keeps them Ready, and plays every pod the scheduler binds to them through a `PodRuntime`:

- `StatusRuntime` (default) runs nothing: a bound pod becomes Running and Ready with a pod IP of its node's range,
  or waits in ImagePullBackOff when its image is one `unpullable` names;
- `tests.support.process_kubelet.ProcessRuntime` runs the containers as local processes, each pod in network
  and mount namespaces of its own with its volumes, and Services by name: enough for `helm install` of the chart.

A deleted pod (deletionTimestamp set) keeps its state for `termination_delay_s` (what a real kubelet's grace period
looks like from the API), then its runtime stops it and the kubelet confirms the deletion (grace period 0), as the
real kubelet's status manager does. Tests make pods fail with `fail()` (e.g. OOMKilled) and `evict()`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from lorafaas.platform.backends.pod_cache import Reflector

log = logging.getLogger(__name__)

LEASE_NAMESPACE = "kube-node-lease"
LEASE_DURATION_S = 40
HEARTBEAT_S = 5.0
KUBELET_VERSION = "v1.20.2"


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class PodRecord:
    """What the kubelet knows of one pod it plays."""

    namespace: str
    name: str
    uid: str
    node: str
    pod_ip: str
    terminating: bool = False
    extra: dict = field(default_factory=dict)  # the runtime's own state


class PodRuntime(Protocol):
    def start(self, kubelet: FakeKubelet, pod: k8s.V1Pod, record: PodRecord) -> dict | None:
        """The pod's first status, for the kubelet to post; None when the runtime posts its statuses itself."""

    def stop(self, record: PodRecord, grace_s: float) -> None: ...

    def close(self) -> None: ...


class StatusRuntime:
    """Runs nothing: pods are Running and Ready at once, unless their image cannot be pulled."""

    def __init__(self, unpullable: Callable[[str], bool] = lambda image: False) -> None:
        self.unpullable = unpullable

    def start(self, kubelet: FakeKubelet, pod: k8s.V1Pod, record: PodRecord) -> dict:
        bad = [c for c in pod.spec.containers if self.unpullable(c.image)]
        if bad:
            return pull_failure_status(pod, bad[0].image)
        return running_status(pod, record.pod_ip, ready=True)

    def stop(self, record: PodRecord, grace_s: float) -> None:
        return None

    def close(self) -> None:
        return None


def container_status(container: k8s.V1Container, state: dict, ready: bool, restarts: int = 0) -> dict:
    return {"name": container.name, "image": container.image, "imageID": f"docker-pullable://{container.image}",
            "containerID": f"fake://{container.name}", "ready": ready, "started": "running" in state,
            "restartCount": restarts, "state": state}


def conditions(ready: bool, initialized: bool = True) -> list[dict]:
    at = now()
    flag = "True" if ready else "False"
    return [
        {"type": "Initialized", "status": "True" if initialized else "False", "lastTransitionTime": at},
        {"type": "Ready", "status": flag, "lastTransitionTime": at},
        {"type": "ContainersReady", "status": flag, "lastTransitionTime": at},
        {"type": "PodScheduled", "status": "True", "lastTransitionTime": at},
    ]


def running_status(pod: k8s.V1Pod, pod_ip: str, ready: bool, restarts: dict | None = None) -> dict:
    started = {"running": {"startedAt": now()}}
    return {
        "phase": "Running", "hostIP": "127.0.0.1", "podIP": pod_ip, "podIPs": [{"ip": pod_ip}], "startTime": now(),
        "qosClass": "Burstable", "conditions": conditions(ready),
        "containerStatuses": [container_status(c, started, ready, (restarts or {}).get(c.name, 0))
                              for c in pod.spec.containers],
        "initContainerStatuses": [
            container_status(c, {"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": now(),
                                                "finishedAt": now()}}, True)
            for c in pod.spec.init_containers or []],
    }


def pull_failure_status(pod: k8s.V1Pod, image: str) -> dict:
    waiting = {"waiting": {"reason": "ImagePullBackOff", "message": f'Back-off pulling image "{image}"'}}
    return {"phase": "Pending", "hostIP": "127.0.0.1", "startTime": now(), "qosClass": "Burstable",
            "conditions": conditions(False),
            "containerStatuses": [container_status(c, waiting, False) for c in pod.spec.containers]}


def terminated_status(pod: k8s.V1Pod, pod_ip: str, reason: str, exit_code: int, message: str = "") -> dict:
    done = {"terminated": {"exitCode": exit_code, "reason": reason, "message": message or None,
                           "startedAt": now(), "finishedAt": now()}}
    return {"phase": "Failed" if exit_code else "Succeeded", "hostIP": "127.0.0.1", "podIP": pod_ip,
            "podIPs": [{"ip": pod_ip}], "qosClass": "Burstable", "conditions": conditions(False),
            "containerStatuses": [container_status(c, done, False) for c in pod.spec.containers]}


class FakeKubelet:
    """Nodes `node_names` for the API server behind `api`; `start()` registers them and follows their pods."""

    def __init__(
        self,
        api: k8s.ApiClient,
        node_names: list[str],
        *,
        runtime: PodRuntime | None = None,
        cpu: str = "8",
        memory: str = "32Gi",
        termination_delay_s: float = 0.5,
        labels: dict[str, str] | None = None,
        kubelet_port: int = 10250,
    ) -> None:
        self.core = k8s.CoreV1Api(api)
        self.coordination = k8s.CoordinationV1Api(api)
        self.runtime = runtime or StatusRuntime()
        self.capacity = {"cpu": cpu, "memory": memory, "pods": "110", "ephemeral-storage": "100Gi"}
        self.termination_delay_s = termination_delay_s
        self.labels = labels or {}
        self.kubelet_port = kubelet_port  # where the API server reaches the nodes (kubelet_server: port-forward)
        self.nodes: dict[str, int] = {}  # name -> index (its pod IP range)
        self.records: dict[str, PodRecord] = {}  # by pod uid
        self._next_ip: dict[str, int] = {}
        self._lock = threading.RLock()
        self._stopped = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self.reflector = Reflector("kubelet pods", self.core.list_pod_for_all_namespaces,
                                   on_list=self._sync_all, on_event=self._on_event)
        for name in node_names:
            self.nodes[name] = len(self.nodes) + 1

    # -- lifecycle ---------------------------------------------------------------------------------------------------

    def start(self, timeout_s: float = 60.0) -> None:
        for name in self.nodes:
            self._register(name)
        self._heartbeat = threading.Thread(target=self._beat_forever, name="kubelet-heartbeat", daemon=True)
        self._heartbeat.start()
        self.reflector.start()
        if not self.reflector.synced.wait(timeout_s):
            raise TimeoutError("the kubelet could not list pods")
        self.wait_nodes_ready(timeout_s)

    def stop(self) -> None:
        self._stopped.set()
        self.reflector.stop()
        self.runtime.close()

    def add_node(self, name: str) -> None:
        with self._lock:
            self.nodes[name] = max(self.nodes.values(), default=0) + 1
        self._register(name)

    def remove_node(self, name: str, delete: bool = True) -> None:
        """The machine goes away: its pods stop, its heartbeats end, and (delete) its Node object is deleted."""
        with self._lock:
            self.nodes.pop(name, None)
            gone = [r for r in self.records.values() if r.node == name]
        for record in gone:
            self.runtime.stop(record, 0)
        if delete:
            with contextlib.suppress(ApiException):
                self.core.delete_node(name)

    def wait_nodes_ready(self, timeout_s: float = 60.0) -> None:
        """Until every node is Ready without the not-ready taint (the scheduler would skip it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            listed = {n.metadata.name: n for n in self.core.list_node().items}
            if all(name in listed and _schedulable(listed[name]) for name in list(self.nodes)):
                return
            time.sleep(0.2)
        raise TimeoutError(f"nodes {sorted(self.nodes)} not ready after {timeout_s:.0f} s")

    # -- what tests do to pods ---------------------------------------------------------------------------------------

    def fail(self, namespace: str, name: str, reason: str = "OOMKilled", exit_code: int = 137,
             message: str = "") -> None:
        """The pod's containers end (e.g. the kernel's OOM killer); the pod fails (restartPolicy Never)."""
        pod = self.core.read_namespaced_pod(name, namespace)
        record = self._record_of(pod)
        if record is not None:
            self.runtime.stop(record, 0)
        self.patch_status(namespace, name, terminated_status(pod, pod.status.pod_ip or "", reason, exit_code,
                                                             message))

    def evict(self, namespace: str, name: str, message: str = "The node was low on resource: memory.") -> None:
        pod = self.core.read_namespaced_pod(name, namespace)
        record = self._record_of(pod)
        if record is not None:
            self.runtime.stop(record, 0)
        status = terminated_status(pod, pod.status.pod_ip or "", "Error", 137)
        status.update(phase="Failed", reason="Evicted", message=message)
        self.patch_status(namespace, name, status)

    def patch_status(self, namespace: str, name: str, status: dict) -> None:
        try:
            self.core.patch_namespaced_pod_status(name, namespace, {"status": status})
        except ApiException as exc:
            if exc.status != 404:  # deleted meanwhile: nothing to report
                raise

    # -- nodes -------------------------------------------------------------------------------------------------------

    def _register(self, name: str) -> None:
        body = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                                      "kubernetes.io/arch": "amd64", **self.labels}}}
        try:
            self.core.create_node(body)
        except ApiException as exc:
            if exc.status != 409:
                raise
        self._post_node_status(name)
        self._renew_lease(name)

    def _post_node_status(self, name: str) -> None:
        at = now()
        status = {
            "capacity": self.capacity, "allocatable": self.capacity,
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": name}],
            "conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "fake kubelet is posting",
                 "lastHeartbeatTime": at, "lastTransitionTime": at},
                *({"type": kind, "status": "False", "reason": f"KubeletHasNo{kind}", "lastHeartbeatTime": at,
                   "lastTransitionTime": at} for kind in ("MemoryPressure", "DiskPressure", "PIDPressure")),
            ],
            "nodeInfo": {"architecture": "amd64", "bootID": name, "containerRuntimeVersion": "fake://1",
                         "kernelVersion": "fake", "kubeProxyVersion": KUBELET_VERSION,
                         "kubeletVersion": KUBELET_VERSION, "machineID": name, "operatingSystem": "linux",
                         "osImage": "lorafaas fake kubelet", "systemUUID": name},
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.kubelet_port}},
        }
        self.core.patch_node_status(name, {"status": status})

    def _renew_lease(self, name: str) -> None:
        spec = {"holderIdentity": name, "leaseDurationSeconds": LEASE_DURATION_S, "renewTime": now_micro()}
        try:
            self.coordination.patch_namespaced_lease(name, LEASE_NAMESPACE, {"spec": spec})
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.coordination.create_namespaced_lease(
                LEASE_NAMESPACE, {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                  "metadata": {"name": name, "namespace": LEASE_NAMESPACE}, "spec": spec})

    def _beat_forever(self) -> None:
        beats = 0
        while not self._stopped.wait(HEARTBEAT_S):
            beats += 1
            for name in list(self.nodes):
                try:
                    self._renew_lease(name)
                    if beats % 4 == 0:
                        self._post_node_status(name)
                except ApiException as exc:
                    if exc.status == 404 and name in self.nodes:  # deleted by someone else: register again
                        self._register(name)
                    elif exc.status != 404:
                        log.warning("node %s: heartbeat failed: %s %s", name, exc.status, exc.reason)
                except OSError as exc:
                    if not self._stopped.is_set():
                        log.warning("node %s: heartbeat failed: %s", name, exc)

    # -- pods --------------------------------------------------------------------------------------------------------

    def _record_of(self, pod: k8s.V1Pod) -> PodRecord | None:
        with self._lock:
            return self.records.get(pod.metadata.uid)

    def _sync_all(self, pods: list[k8s.V1Pod]) -> None:
        for pod in pods:
            self._sync(pod)

    def _on_event(self, kind: str, pod: k8s.V1Pod) -> None:
        if kind == "DELETED":
            with self._lock:
                record = self.records.pop(pod.metadata.uid, None)
            if record is not None and not record.terminating:
                self.runtime.stop(record, 0)  # force-deleted: the kubelet only learns it now
            return
        self._sync(pod)

    def _sync(self, pod: k8s.V1Pod) -> None:
        node = pod.spec.node_name
        if node not in self.nodes:
            return
        uid = pod.metadata.uid
        with self._lock:
            record = self.records.get(uid)
            if record is None:
                if pod.status is not None and pod.status.phase in ("Failed", "Succeeded"):
                    return  # over before we knew it (a restarted kubelet)
                record = PodRecord(pod.metadata.namespace, pod.metadata.name, uid, node, self._allocate_ip(node))
                self.records[uid] = record
                fresh = True
            else:
                fresh = False
            terminate = pod.metadata.deletion_timestamp is not None and not record.terminating
            if terminate:
                record.terminating = True
        if terminate:
            grace = pod.metadata.deletion_grace_period_seconds or 0
            threading.Thread(target=self._terminate, args=(record, grace), daemon=True,
                             name=f"terminate-{record.name}").start()
        elif fresh:
            try:
                status = self.runtime.start(self, pod, record)
            except OSError as exc:  # the container could not be created
                waiting = {"waiting": {"reason": "RunContainerError", "message": str(exc)}}
                status = {"phase": "Pending", "conditions": conditions(False),
                          "containerStatuses": [container_status(c, waiting, False) for c in pod.spec.containers]}
            if status is not None:
                self.patch_status(record.namespace, record.name, status)

    def _terminate(self, record: PodRecord, grace_s: float) -> None:
        """Graceful deletion: the pod stays (with its deletionTimestamp) while its containers stop, then goes."""
        if grace_s > 0:
            time.sleep(min(grace_s, self.termination_delay_s))
        self.runtime.stop(record, grace_s)
        with contextlib.suppress(ApiException):
            self.core.delete_namespaced_pod(record.name, record.namespace, grace_period_seconds=0,
                                            body=k8s.V1DeleteOptions(grace_period_seconds=0,
                                                                     preconditions={"uid": record.uid}))

    def _allocate_ip(self, node: str) -> str:
        n = self._next_ip.get(node, 1)
        self._next_ip[node] = n + 1
        return f"10.244.{self.nodes[node]}.{n % 250 + 1}"


def _schedulable(node: k8s.V1Node) -> bool:
    ready = any(c.type == "Ready" and c.status == "True" for c in (node.status.conditions or []))
    tainted = any(t.key.startswith("node.kubernetes.io/") for t in (node.spec.taints or []))
    return ready and not tainted
