"""The Kubernetes backend on the objects it sends: a recording fake of the CoreV1Api boundary (no cluster can run
here) that keeps pods like an API server and plays the kubelet's part when a pod is read. The function pod template
is the one the real chart renders, and every pod the backend builds validates against the Kubernetes 1.30 schemas."""

import copy
import json
import signal
from pathlib import Path

import kubernetes_validate
import msgspec
import pytest
import yaml

helm = pytest.importorskip("helm_python")
k8s = pytest.importorskip("kubernetes.client")

from kubernetes.client.exceptions import ApiException  # noqa: E402

from lorafaas.errors import DaemonUnavailable, InstanceUnavailable  # noqa: E402
from lorafaas.platform.backends import Backend, InstanceRef  # noqa: E402
from lorafaas.platform.backends.kubernetes import (  # noqa: E402
    ANNOTATION_INSTANCE_ID,
    ANNOTATION_SPEC,
    KubernetesBackend,
    KubernetesConfig,
)

CHART = Path(__file__).resolve().parents[2] / "manifests" / "charts" / "lorafaas"
KUBERNETES_VERSION = "1.30"
NAMESPACE = "lf"
TEMPLATE_UID = "3f1c2a4e-0000-4000-8000-000000000001"


def rendered_template_config_map() -> k8s.V1ConfigMap:
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(name="lorafaas", namespace=NAMESPACE, is_install=True)
    data = yaml.safe_load(rendered["lorafaas/templates/function-pod-template.yaml"])
    data["metadata"]["uid"] = TEMPLATE_UID
    return k8s.ApiClient().deserialize(json.dumps(data), "V1ConfigMap", None)


def agent_pod(name: str, node: str, backbones: str, ready: bool = True) -> k8s.V1Pod:
    return k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(
            name=name,
            namespace=NAMESPACE,
            annotations={"lorafaas.io/backbones": backbones},
            labels={"app.kubernetes.io/instance": "lorafaas", "app.kubernetes.io/component": "node-agent"},
        ),
        spec=k8s.V1PodSpec(node_name=node, containers=[k8s.V1Container(name="daemon", image="x")]),
        status=running_status("10.0.0.1", ready),
    )


def running_status(pod_ip: str, ready: bool = True) -> k8s.V1PodStatus:
    return k8s.V1PodStatus(
        phase="Running",
        pod_ip=pod_ip,
        conditions=[k8s.V1PodCondition(type="Ready", status="True" if ready else "False")],
    )


def waiting_status(reason: str, message: str) -> k8s.V1PodStatus:
    state = k8s.V1ContainerState(waiting=k8s.V1ContainerStateWaiting(reason=reason, message=message))
    return k8s.V1PodStatus(
        phase="Pending",
        container_statuses=[
            k8s.V1ContainerStatus(name="worker", image="x", image_id="", ready=False, restart_count=0, state=state)
        ],
    )


class RecordingCoreV1:
    """Pods and ConfigMaps kept like an API server; every call recorded. `kubelet(pod)` returns the status a pod has
    when it is read (default: running and ready)."""

    def __init__(self, agents: list[k8s.V1Pod]) -> None:
        self.calls: list[tuple[str, object]] = []
        self.pods: dict[str, k8s.V1Pod] = {p.metadata.name: p for p in agents}
        self.config_maps = {"lorafaas-function-pod": rendered_template_config_map()}
        self.kubelet = lambda pod: running_status(f"10.1.0.{len(self.pods)}")
        self.watch_events: list[dict] = []

    def read_namespaced_config_map(self, name: str, namespace: str) -> k8s.V1ConfigMap:
        self.calls.append(("read_config_map", name))
        if name not in self.config_maps:
            raise ApiException(status=404, reason="Not Found")
        return self.config_maps[name]

    def list_namespaced_pod(
        self, namespace: str, label_selector: str = "", watch: bool = False, **kwargs
    ) -> "V1PodList":  # noqa: F821 (the watch helper reads this annotation)
        wanted = dict(pair.split("=") for pair in label_selector.split(",") if pair)
        if watch:
            self.calls.append(("watch_pods", label_selector))
            return FakeStream(self.watch_events)
        self.calls.append(("list_pods", label_selector))
        items = [
            copy.deepcopy(p)
            for p in self.pods.values()
            if all((p.metadata.labels or {}).get(k) == v for k, v in wanted.items())
        ]
        return k8s.V1PodList(items=items)

    def create_namespaced_pod(self, namespace: str, body: k8s.V1Pod) -> k8s.V1Pod:
        self.calls.append(("create_pod", body))
        if body.metadata.name in self.pods:
            raise ApiException(status=409, reason="AlreadyExists")
        pod = copy.deepcopy(body)
        pod.status = k8s.V1PodStatus(phase="Pending")
        self.pods[pod.metadata.name] = pod
        return pod

    def read_namespaced_pod(self, name: str, namespace: str) -> k8s.V1Pod:
        if name not in self.pods:
            raise ApiException(status=404, reason="Not Found")
        pod = self.pods[name]
        pod.status = self.kubelet(pod)
        return copy.deepcopy(pod)

    def delete_namespaced_pod(self, name: str, namespace: str, grace_period_seconds: int = 30) -> None:
        self.calls.append(("delete_pod", (name, grace_period_seconds)))
        if self.pods.pop(name, None) is None:
            raise ApiException(status=404, reason="Not Found")

    def made(self, kind: str) -> list:
        return [arg for call, arg in self.calls if call == kind]


class FakeStream:
    """A watch response: one JSON event per line."""

    def __init__(self, events: list[dict]) -> None:
        self.lines = [json.dumps(e) + "\n" for e in events]

    def stream(self, amt=None, decode_content=False):
        yield from (line.encode() for line in self.lines)

    def close(self) -> None: ...

    def release_conn(self) -> None: ...


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def core() -> RecordingCoreV1:
    return RecordingCoreV1(
        [
            agent_pod("agent-a", "node-a", "smollm2-135m,tiny"),
            agent_pod("agent-b", "node-b", "other"),
            agent_pod("agent-c", "node-c", "smollm2-135m", ready=False),
        ]
    )


@pytest.fixture
def backend(core: RecordingCoreV1, tmp_path: Path) -> KubernetesBackend:
    (tmp_path / "models" / "smollm2-135m").mkdir(parents=True)
    config = KubernetesConfig(
        namespace=NAMESPACE, release="lorafaas", pod_template="lorafaas-function-pod", home=tmp_path
    )
    clock = FakeClock()
    return KubernetesBackend(config, core=core, clock=clock, sleep=clock.sleep)


def validate(backend: KubernetesBackend, pod: k8s.V1Pod) -> None:
    kubernetes_validate.validate(backend.to_dict(pod), KUBERNETES_VERSION, strict=True)


def test_the_backend_satisfies_the_protocol_the_node_agent_types_against(backend) -> None:
    assert isinstance(backend, Backend)
    assert backend.zygote_pid is None  # no library pool: the node agent skips it
    assert backend.stop_daemon("smollm2-135m") is False  # the DaemonSet's daemons are not ours to stop


def test_a_function_pod_is_built_from_the_template_placed_on_backbone_nodes_and_valid(backend, core) -> None:
    spec = backend.spec("pirate", "smollm2-135m", Path("/var/lib/lorafaas/adapters/abc"))
    assert spec.socket_path == "tcp://0.0.0.0:9000"
    assert spec.daemon_socket.endswith("run/smollm2-135m@cpu.sock")
    pod = backend.build_pod(spec, "smollm2-135m", backend.backbone_nodes("smollm2-135m"))
    validate(backend, pod)
    body = backend.to_dict(pod)
    labels = body["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == "function"
    assert labels["app.kubernetes.io/instance"] == "lorafaas"
    assert labels["lorafaas.io/function"] == "pirate" and labels["lorafaas.io/backbone"] == "smollm2-135m"
    assert body["metadata"]["annotations"][ANNOTATION_INSTANCE_ID] == spec.instance_id
    assert msgspec.json.decode(body["metadata"]["annotations"][ANNOTATION_SPEC], type=type(spec)) == spec
    assert body["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "name": "lorafaas-function-pod",
            "uid": TEMPLATE_UID,
            "blockOwnerDeletion": False,
        }
    ]
    # only node-a: node-b's agent serves another backbone, node-c's agent is not ready
    terms = body["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-a"]}]}
    ]
    worker = body["spec"]["containers"][0]
    assert worker["args"] == [msgspec.json.encode(spec).decode()]
    assert worker["ports"] == [{"name": "worker", "containerPort": 9000, "protocol": "TCP"}]
    assert worker["readinessProbe"]["tcpSocket"] == {"port": "worker"}
    assert body["spec"]["restartPolicy"] == "Never"
    # what the template brought: the shared home and /dev/shm, the image, no service-account token
    assert {m["mountPath"] for m in worker["volumeMounts"]} == {"/var/lib/lorafaas", "/dev/shm"}
    assert worker["image"] == "lorafaas/function:0.1.0"
    assert body["spec"]["automountServiceAccountToken"] is False
    assert body["spec"]["hostIPC"] is True


def test_launch_creates_the_pod_returns_it_ready_and_kill_deletes_it(backend, core) -> None:
    instance = backend.launch(backend.spec("pirate", "smollm2-135m", None))
    assert isinstance(instance, InstanceRef)
    [created] = core.made("create_pod")
    validate(backend, created)
    assert created.metadata.name == instance.pod_name and instance.pod_name in core.pods
    assert instance.address == f"tcp://{core.pods[instance.pod_name].status.pod_ip}:9000"
    assert instance.alive() and backend.instances == [instance]
    instance.kill(signal.SIGTERM, timeout_s=7)
    assert core.made("delete_pod") == [(instance.pod_name, 7)]
    assert instance.pod_name not in core.pods and backend.instances == []
    assert not instance.alive()
    instance.kill(signal.SIGKILL)  # already gone: not an error
    assert core.made("delete_pod")[-1] == (instance.pod_name, 0)


def test_a_pod_that_cannot_pull_its_image_fails_the_launch_is_deleted_and_recorded(backend, core) -> None:
    core.kubelet = lambda pod: waiting_status("ImagePullBackOff", 'Back-off pulling image "lorafaas/function"')
    spec = backend.spec("pirate", "smollm2-135m", None)
    with pytest.raises(InstanceUnavailable, match="ImagePullBackOff"):
        backend.launch(spec)
    assert backend.pod_name(spec) not in core.pods
    [failure] = backend.describe_failures("pirate")
    assert failure["reason"] == "ImagePullBackOff" and failure["instance_id"] == spec.instance_id
    assert "Back-off pulling image" in failure["message"]
    assert backend.instances == []


def test_an_unschedulable_pod_times_out_with_the_schedulers_reason(backend, core) -> None:
    core.kubelet = lambda pod: k8s.V1PodStatus(
        phase="Pending",
        conditions=[
            k8s.V1PodCondition(
                type="PodScheduled", status="False", reason="Unschedulable", message="0/3 nodes: Insufficient memory"
            )
        ],
    )
    with pytest.raises(InstanceUnavailable, match="Insufficient memory"):
        backend.launch(backend.spec("pirate", "smollm2-135m", None), timeout_s=5)
    assert [f["reason"] for f in backend.describe_failures("pirate")] == ["Unschedulable"]
    assert core.pods.keys() == {"agent-a", "agent-b", "agent-c"}


def test_a_backbone_no_ready_agent_serves_creates_no_pod(backend, core) -> None:
    with pytest.raises(DaemonUnavailable, match=r"nodeAgent\.backbones"):
        backend.spec("pirate", "missing", None)
    spec = msgspec.structs.replace(backend.spec("pirate", "smollm2-135m", None), model_dir="/x/models/other-only")
    with pytest.raises(DaemonUnavailable, match="other-only"):
        backend.launch(spec)
    assert core.made("create_pod") == []
    assert backend.running_backbones() == ["other", "smollm2-135m", "tiny"]


def test_reconcile_after_a_restart_adopts_deletes_orphans_and_failed_pods_creates_missing(
    backend, core, tmp_path: Path
) -> None:
    specs = [backend.spec(name, "smollm2-135m", None) for name in ("kept", "crashed", "orphan", "missing")]
    for spec in specs[:3]:
        backend.launch(spec)
    crashed_pod = backend.pod_name(specs[1])
    core.pods[crashed_pod].metadata.annotations["test/oom"] = "yes"  # this pod, not the one made to replace it
    core.kubelet = lambda pod: (
        k8s.V1PodStatus(
            phase="Failed",
            container_statuses=[
                k8s.V1ContainerStatus(
                    name="worker",
                    image="x",
                    image_id="",
                    ready=False,
                    restart_count=0,
                    state=k8s.V1ContainerState(
                        terminated=k8s.V1ContainerStateTerminated(exit_code=137, reason="OOMKilled")
                    ),
                )
            ],
        )
        if "test/oom" in pod.metadata.annotations
        else running_status("10.2.0.9")
    )
    for pod in core.pods.values():  # what a list shows: the statuses as they are now
        pod.status = core.kubelet(pod)

    restarted = KubernetesBackend(backend.config, core=core, clock=backend.clock, sleep=backend.sleep)
    core.calls.clear()
    wanted = [specs[0], specs[1], specs[3]]
    result = restarted.reconcile(wanted)
    assert result.adopted == (specs[0].instance_id,)
    assert set(result.deleted) == {crashed_pod, backend.pod_name(specs[2])}
    assert result.created == (specs[1].instance_id, specs[3].instance_id)
    assert sorted(i.spec.instance_id for i in restarted.instances) == sorted(s.instance_id for s in wanted)
    assert [f["reason"] for f in restarted.describe_failures("crashed")] == ["OOMKilled"]
    assert restarted.describe_failures("crashed")[0]["exit_code"] == 137
    for created in core.made("create_pod"):
        validate(restarted, created)

    core.calls.clear()
    again = restarted.reconcile(wanted)  # idempotent: nothing to adopt, delete or create
    assert (again.adopted, again.created, again.deleted) == ((), (), ())
    assert core.made("create_pod") == [] and core.made("delete_pod") == []
    assert {s.instance_id for s in restarted.adoptable_specs()} == {s.instance_id for s in wanted}


def test_watch_records_failures_of_running_pods(backend, core) -> None:
    instance = backend.launch(backend.spec("pirate", "smollm2-135m", None))
    pod = backend.to_dict(core.pods[instance.pod_name])
    evicted = {**pod, "status": {"phase": "Failed", "reason": "Evicted", "message": "The node was low on memory."}}
    core.watch_events = [
        {"type": "MODIFIED", "object": pod},
        {"type": "MODIFIED", "object": evicted},
        {"type": "MODIFIED", "object": evicted},
    ]
    assert backend.watch(timeout_s=1) == 1  # recorded once, however often it is seen
    assert core.made("watch_pods") == ["app.kubernetes.io/instance=lorafaas,app.kubernetes.io/component=function"]
    [failure] = backend.describe_failures("pirate")
    assert failure["reason"] == "Evicted" and "low on memory" in failure["message"]


def test_close_deletes_every_pod_it_launched(backend, core) -> None:
    launched = [backend.launch(backend.spec(name, "smollm2-135m", None)) for name in ("a", "b")]
    backend.close()
    assert {name for name, _ in core.made("delete_pod")} == {i.pod_name for i in launched}
    assert backend.instances == []
