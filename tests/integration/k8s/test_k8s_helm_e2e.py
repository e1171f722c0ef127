"""`helm install` of the chart, unmodified and with its **default values**, onto three nodes of the process kubelet:
the real API server, scheduler, controllers and garbage collector; every pod the release makes (the controller, Redis,
the node agents' DaemonSet, the function pods) runs as real processes in its own network and mount namespaces, with
its volumes (a hostPath is each node's own directory), its service account token and Services by name
(`tests/support/process_kubelet.py`).

The values are the chart's defaults: the home a hostPath on each node (no volume shared between nodes), the built-in
backbone imported by each node agent, the default resources. The cluster provides what any cluster does (a volume
for Redis's claim); the images' entrypoints map to this checkout's code.

Two functions deployed through the gateway's Service answer the `openai` client as the local platform does, from pods
on every node (each pod fetches its adapter from the controller); they scale to zero and back; a SIGKILLed function
pod process and a SIGKILLed node agent daemon are replaced and the functions keep answering; a node is deleted and its
function comes back on another node; a deleted function leaves no copy of its adapter on any node.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import os
import secrets
import shutil
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from k8s_env import CHART, require_process_kubelet, wait_until
from kubernetes.client.exceptions import ApiException

from lorafaas.platform.api_client import ApiClient
from lorafaas.testing.platform_process import PlatformProcess
from tests.support.fake_kubelet import FakeKubelet
from tests.support.k8s_cluster import ControlPlane
from tests.support.process_kubelet import ProcessRuntime

helm = pytest.importorskip("helm_python")
k8s = pytest.importorskip("kubernetes.client")
openai = pytest.importorskip("openai")

NODES = ("helm-1", "helm-2", "helm-3")
RELEASE = "lorafaas"
BACKBONE = "smollm2-135m"  # the chart's default, imported by every node agent
DEMO_ADAPTERS = CHART.parents[2] / "examples" / "adapters"
ADAPTERS = {"alpha": DEMO_ADAPTERS / "pirate", "beta": DEMO_ADAPTERS / "french"}
PROMPT = "The ocean is"
ENTRYPOINTS = {  # each image's ENTRYPOINT (manifests/images/*/Dockerfile)
    "lorafaas/gateway": ["python", "-m", "lorafaas"],
    "lorafaas/node-agent": ["python", "-m", "lorafaas"],
    "lorafaas/function": ["python", "-m", "lorafaas.function_runtime.worker"],
    # the official image's docker-entrypoint.sh runs its arguments, turning off protected mode for a redis-server
    # without a config file (the container's network is its own); this machine's redis-server has it on
    "redis": ["sh", "-c", '[ "$1" = redis-server ] && set -- "$@" --protected-mode no; exec "$@"', "entrypoint"],
}
ELSEWHERE = {"key": "lorafaas.test/not-for-the-release", "effect": "NoSchedule"}


def pod_ready(pod) -> bool:
    """The pod's Ready condition is True (as the kubelet reports it)."""
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


@dataclass
class HelmCluster:
    plane: ControlPlane
    kubelet: FakeKubelet
    runtime: ProcessRuntime
    namespace: str

    @property
    def core(self) -> k8s.CoreV1Api:
        return k8s.CoreV1Api(self.plane.api_client())

    def pods(self, component: str, **labels: str) -> list:
        selector = ",".join([f"app.kubernetes.io/component={component}", *(f"{k}={v}" for k, v in labels.items())])
        return [p for p in self.core.list_namespaced_pod(self.namespace, label_selector=selector).items
                if p.metadata.deletion_timestamp is None and p.status.phase == "Running"]

    def ready(self, component: str) -> list:
        return [p for p in self.pods(component) if pod_ready(p)]

    def function_pods(self, function: str) -> list:
        return self.pods("function", **{"lorafaas.io/function": function})

    def account(self, log_tail: int = 1500) -> str:
        """Every pod of the release (node, phase, readiness, containers' states, deletion) and the tails of the
        controller's and the function pods' logs: what a timed-out wait prints."""
        lines, logged = [], []
        for pod in self.core.list_namespaced_pod(self.namespace).items:
            states = [f"{c.name}:{next((k for k, v in c.state.to_dict().items() if v), '?')}"
                      f"(restarts {c.restart_count})" for c in pod.status.container_statuses or []]
            lines.append(f"pod {pod.metadata.name} on {pod.spec.node_name}: {pod.status.phase}, "
                         f"ready={pod_ready(pod)}, deleting={pod.metadata.deletion_timestamp is not None}, "
                         f"{' '.join(states)}")
            if (pod.metadata.labels or {}).get("app.kubernetes.io/component") in ("controller", "function"):
                logged.append(pod.metadata.name)
        for name in logged:
            for log in sorted(self.runtime.work_dir.glob(f"{name}.*.log")):
                tail = log.read_bytes()[-log_tail:].decode(errors="replace")
                lines.append(f"--- {log.name} (last {log_tail} bytes)\n{tail}")
        return "\n".join(lines)

    def pod(self, name: str):
        try:
            return self.core.read_namespaced_pod(name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise


@pytest.fixture
def helm_cluster(control_plane: ControlPlane, tmp_path: Path) -> Iterator[HelmCluster]:
    require_process_kubelet()
    api = control_plane.api_client()
    core = k8s.CoreV1Api(api)
    namespace = f"helm-{secrets.token_hex(3)}"
    core.create_namespace({"metadata": {"name": namespace}})
    control_plane.wait_default_service_account(namespace)
    # other tests' nodes (the session's status-only kubelet) must not get the release's pods
    others = [n.metadata.name for n in core.list_node().items if n.metadata.name not in NODES]
    for node in others:
        core.patch_node(node, {"spec": {"taints": [ELSEWHERE]}})
    runtime = ProcessRuntime(api, tmp_path / "kubelet", ENTRYPOINTS)
    kubelet = FakeKubelet(api, list(NODES), runtime=runtime)
    volumes = {f"{namespace}-redis": (f"data-{RELEASE}-redis-0", "ReadWriteOnce",
                                      {"hostPath": {"path": "/srv/redis", "type": "DirectoryOrCreate"}})}
    try:
        for volume, (claim, mode, source) in volumes.items():
            core.create_persistent_volume({"metadata": {"name": volume}, "spec": {
                "capacity": {"storage": "1Gi"}, "accessModes": [mode], "persistentVolumeReclaimPolicy": "Retain",
                "claimRef": {"namespace": namespace, "name": claim}, **source}})
        kubelet.start()
        yield HelmCluster(control_plane, kubelet, runtime, namespace)
    finally:
        kubelet.stop()
        for node in list(kubelet.nodes):
            kubelet.remove_node(node)
        core.delete_namespace(namespace, body=k8s.V1DeleteOptions(grace_period_seconds=0))
        for volume in volumes:
            core.delete_persistent_volume(volume)
        for node in others:
            core.patch_node(node, {"spec": {"taints": None}})


def complete(client, function: str) -> str:
    reply = client.completions.create(model=function, prompt=PROMPT, max_tokens=6, temperature=0)
    return reply.choices[0].text


def adapter_copies(runtime: ProcessRuntime, adapter_dir: Path) -> list[Path]:
    """Every copy of the adapter's weights anywhere the kubelet keeps files: the nodes' directories (hostPath homes)
    and the pods' own volumes."""
    wanted = hashlib.sha256((adapter_dir / "adapter_model.safetensors").read_bytes()).digest()
    return [path for path in runtime.work_dir.rglob("adapter_model.safetensors")
            if hashlib.sha256(path.read_bytes()).digest() == wanted]


@pytest.mark.timeout(2400)  # three built-in backbone imports and a dozen cold starts: 10 minutes at load 8 on 2 cores
def test_helm_install_with_default_values_on_three_process_nodes_serves_from_every_node_and_survives(
        helm_cluster: HelmCluster, tmp_path: Path) -> None:
    cluster, core = helm_cluster, helm_cluster.core
    namespace, runtime = cluster.namespace, cluster.runtime
    values: dict = {}  # the chart's defaults: nothing here needs setting (Redis's claim is bound by the cluster)
    with helm.Config(kubeconfig_path=str(cluster.plane.kubeconfig), namespace=namespace) as config:
        release = config.install(str(CHART), RELEASE, values, namespace=namespace)
    assert release["status"] == "deployed", {k: v for k, v in release.items() if k != "manifest"}

    # each agent imports the built-in backbone into its own node's directory first
    wait_until(lambda: len(cluster.ready("node-agent")) == len(NODES), "a ready node agent on every node", 1200)
    [controller] = wait_until(lambda: cluster.ready("controller"), "the controller ready", 180)
    [redis] = wait_until(lambda: cluster.ready("redis"), "Redis ready", 60)
    service = core.read_namespaced_service(f"{RELEASE}-controller", namespace)
    url = f"http://{service.spec.cluster_ip}:{service.spec.ports[0].port}"  # the gateway's Service
    secret = core.read_namespaced_secret(f"{RELEASE}-admin-key", namespace)
    admin_key = base64.b64decode(secret.data["admin-key"]).decode()

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=admin_key, max_retries=2)
    with ApiClient(url, admin_key) as api:
        for name, adapter in ADAPTERS.items():
            api.deploy({"name": name, "backbone": BACKBONE, "keep_alive_s": 5}, adapter)
        first = {name: complete(client, name) for name in ADAPTERS}
        assert all(first.values())

        # both functions served from a pod on every node, one node at a time (the others cordoned): the adapter
        # store is on the controller's node only, so every other node's pods fetch their adapter from it
        for node in NODES:
            for other in NODES:
                core.patch_node(other, {"spec": {"unschedulable": other != node}})
            for name in ADAPTERS:
                for pod in cluster.function_pods(name):
                    if pod.spec.node_name != node:
                        core.delete_namespaced_pod(pod.metadata.name, namespace)
                        wait_until(lambda pod=pod: cluster.pod(pod.metadata.name) is None, "the pod gone", 60)
                assert complete(client, name) == first[name]
                [pod] = cluster.function_pods(name)  # one worker process, on this node, at its own address
                assert pod.spec.node_name == node, (name, pod.spec.node_name)
                assert ipaddress.ip_address(pod.status.pod_ip) in runtime.network.subnet, pod.status
        for node in NODES:
            core.patch_node(node, {"spec": {"unschedulable": False}})

        # scale to zero: idle past keep-alive, the pods go; the next request starts one again
        wait_until(lambda: not cluster.pods("function"), "every function pod retired after keep-alive", 90)
        assert complete(client, "alpha") == first["alpha"]

        # SIGKILL the function pod's worker process: the pod fails, a new one serves
        [pod] = cluster.function_pods("alpha")
        os.killpg(runtime.pids(pod.metadata.uid)["worker"], signal.SIGKILL)
        wait_until(lambda: (p := cluster.pod(pod.metadata.name)) is None or p.status.phase == "Failed",
                   "the killed pod failed", 60)
        assert complete(client, "alpha") == first["alpha"]
        assert any(f["reason"] in ("Error", "exited unexpectedly") for f in api.describe("alpha")["failures"])

        # lose a node serving beta (one without the controller or Redis, whose own recovery is not this test's):
        # beta comes back on another node
        keep = {controller.spec.node_name, redis.spec.node_name}
        spare = next(n for n in NODES if n not in keep)
        complete(client, "beta")
        [pod] = cluster.function_pods("beta")
        if pod.spec.node_name in keep:  # move beta to the spare node first: only it takes new pods for a while
            for node in NODES:
                core.patch_node(node, {"spec": {"unschedulable": node != spare}})
            core.delete_namespaced_pod(pod.metadata.name, namespace)
            wait_until(lambda: cluster.pod(pod.metadata.name) is None, "beta's pod gone", 60)
            assert complete(client, "beta") == first["beta"]
            [pod] = cluster.function_pods("beta")
            for node in NODES:
                core.patch_node(node, {"spec": {"unschedulable": False}})
        lost = pod.spec.node_name
        assert lost == spare or lost not in keep
        cluster.kubelet.remove_node(lost)
        assert complete(client, "beta") == first["beta"]
        [again] = cluster.function_pods("beta")
        assert again.spec.node_name != lost

        # SIGKILL a node agent's daemon: the kubelet restarts it; the functions keep serving
        [agent] = [p for p in cluster.ready("node-agent") if p.spec.node_name == again.spec.node_name]
        container = f"daemon-{BACKBONE}"
        os.killpg(runtime.pids(agent.metadata.uid)[container], signal.SIGKILL)
        wait_until(lambda: next(s for s in cluster.pod(agent.metadata.name).status.container_statuses
                                if s.name == container).restart_count == 1, "the agent's daemon restarted", 60)
        assert complete(client, "alpha") == first["alpha"]
        assert complete(client, "beta") == first["beta"]

        # a deleted function leaves no copy of its adapter on any node; a live one's copies are its pods' own
        # and the controller's store
        assert adapter_copies(runtime, ADAPTERS["alpha"])
        api.delete("alpha")
        wait_until(lambda: not adapter_copies(runtime, ADAPTERS["alpha"]), "alpha's adapter gone from every node", 90)
        store = runtime.work_dir / "nodes" / controller.spec.node_name
        beta_pods = {p.metadata.name for p in cluster.function_pods("beta")}
        for copy in adapter_copies(runtime, ADAPTERS["beta"]):
            assert copy.is_relative_to(store) or any(f".{name}." in str(copy) for name in beta_pods), copy
        assert complete(client, "beta") == first["beta"]

    # the same functions on the local platform (processes, no Kubernetes) answer the same
    local_home = tmp_path / "local"
    node_models = store / "var" / "lib" / "lorafaas" / "models"  # the entry the controller's node agent imported
    shutil.copytree(node_models / BACKBONE, local_home / "models" / BACKBONE)
    with PlatformProcess(local_home) as local, ApiClient(local.url, local.admin_key) as api:
        local_client = openai.OpenAI(base_url=f"{local.url}/v1", api_key=local.admin_key)
        for name, adapter in ADAPTERS.items():
            api.deploy({"name": name, "backbone": BACKBONE}, adapter)
            assert complete(local_client, name) == first[name]
