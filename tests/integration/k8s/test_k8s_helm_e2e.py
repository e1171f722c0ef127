"""`helm install` of the chart, unmodified, onto three nodes of the process kubelet: the real API server, scheduler,
controllers and garbage collector; every pod the release makes (the controller, Redis, the node agents' DaemonSet, the
function pods) runs as real processes in its own network and mount namespaces, with its volumes, its service account
token and Services by name (`tests/support/process_kubelet.py`).

The values are what a user of a three-node CPU cluster passes: the home on a ReadWriteMany claim (an NFS volume; its
server is this machine), each node's daemon sockets on the node (`home.runHostPath`), Redis on a statically
provisioned volume, small resources and a small backbone imported into the home beforehand. The images' entrypoints
map to this checkout's code.

Two functions deployed through the gateway's Service answer the `openai` client as the local platform does; they scale
to zero and back; a SIGKILLed function pod process and a SIGKILLed node agent daemon are replaced and the functions keep
answering; a node is deleted and its function comes back on another node.
"""

from __future__ import annotations

import base64
import ipaddress
import os
import secrets
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
BACKBONE = "tiny-dense"
PROMPT = "The ocean is"
ENTRYPOINTS = {  # each image's ENTRYPOINT (manifests/images/*/Dockerfile)
    "lorafaas/gateway": ["python", "-m", "lorafaas"],
    "lorafaas/node-agent": ["python", "-m", "lorafaas"],
    "lorafaas/function": ["python", "-m", "lorafaas.function_runtime.worker"],
    # the official image's docker-entrypoint.sh runs its arguments, turning off protected mode for a redis-server
    # without a config file (the container's network is its own); this machine's redis-server has it on
    "redis": ["sh", "-c", '[ "$1" = redis-server ] && set -- "$@" --protected-mode no; exec "$@"', "entrypoint"],
}
SMALL = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}}
ELSEWHERE = {"key": "lorafaas.test/not-for-the-release", "effect": "NoSchedule"}


@dataclass
class HelmCluster:
    plane: ControlPlane
    kubelet: FakeKubelet
    runtime: ProcessRuntime
    namespace: str
    nfs_home: Path

    @property
    def core(self) -> k8s.CoreV1Api:
        return k8s.CoreV1Api(self.plane.api_client())

    def pods(self, component: str, **labels: str) -> list:
        selector = ",".join([f"app.kubernetes.io/component={component}", *(f"{k}={v}" for k, v in labels.items())])
        return [p for p in self.core.list_namespaced_pod(self.namespace, label_selector=selector).items
                if p.metadata.deletion_timestamp is None and p.status.phase == "Running"]

    def ready(self, component: str) -> list:
        return [p for p in self.pods(component)
                if any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])]

    def function_pods(self, function: str) -> list:
        return self.pods("function", **{"lorafaas.io/function": function})

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
    nfs_home = tmp_path / "nfs" / "home"
    nfs_home.mkdir(parents=True)
    volumes = {f"{namespace}-home": ("lorafaas-home", "ReadWriteMany", {"nfs": {"server": "127.0.0.1",
                                                                                 "path": str(nfs_home)}}),
               f"{namespace}-redis": (f"data-{RELEASE}-redis-0", "ReadWriteOnce",
                                      {"hostPath": {"path": "/srv/redis", "type": "DirectoryOrCreate"}})}
    try:
        for volume, (claim, mode, source) in volumes.items():
            core.create_persistent_volume({"metadata": {"name": volume}, "spec": {
                "capacity": {"storage": "1Gi"}, "accessModes": [mode], "persistentVolumeReclaimPolicy": "Retain",
                "claimRef": {"namespace": namespace, "name": claim}, **source}})
        core.create_namespaced_persistent_volume_claim(namespace, {"metadata": {"name": "lorafaas-home"}, "spec": {
            "accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}})
        kubelet.start()
        yield HelmCluster(control_plane, kubelet, runtime, namespace, nfs_home)
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


def test_helm_install_on_three_process_nodes_serves_scales_and_survives_kills_and_a_lost_node(
        helm_cluster: HelmCluster, tmp_path: Path, tiny_dense_dir: Path, tiny_adapter_dir: Path, cli) -> None:
    cluster, core = helm_cluster, helm_cluster.core
    namespace, runtime = cluster.namespace, cluster.runtime
    # the backbone in the shared home, as an operator would put it there
    assert cli("--home", str(cluster.nfs_home), "backbone", "import", BACKBONE, "--from",
               str(tiny_dense_dir)).returncode == 0
    values = {
        "home": {"existingClaim": "lorafaas-home", "runHostPath": "/var/run/lorafaas"},
        "controller": {"resources": SMALL},
        "nodeAgent": {"backbones": [BACKBONE], "importBuiltin": False, "resources": SMALL},
        "function": {"resources": SMALL},
        "redis": {"resources": SMALL},
    }
    with helm.Config(kubeconfig_path=str(cluster.plane.kubeconfig), namespace=namespace) as config:
        release = config.install(str(CHART), RELEASE, values, namespace=namespace)
    assert release["status"] == "deployed", {k: v for k, v in release.items() if k != "manifest"}

    wait_until(lambda: len(cluster.ready("node-agent")) == len(NODES), "a ready node agent on every node", 180)
    [controller] = wait_until(lambda: cluster.ready("controller"), "the controller ready", 180)
    [redis] = wait_until(lambda: cluster.ready("redis"), "Redis ready", 60)
    service = core.read_namespaced_service(f"{RELEASE}-controller", namespace)
    url = f"http://{service.spec.cluster_ip}:{service.spec.ports[0].port}"  # the gateway's Service
    secret = core.read_namespaced_secret(f"{RELEASE}-admin-key", namespace)
    admin_key = base64.b64decode(secret.data["admin-key"]).decode()

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=admin_key, max_retries=2)
    with ApiClient(url, admin_key) as api:
        for name in ("alpha", "beta"):
            api.deploy({"name": name, "backbone": BACKBONE, "keep_alive_s": 5}, tiny_adapter_dir)
        first = {}
        for name in ("alpha", "beta"):
            first[name] = complete(client, name)
            [pod] = cluster.function_pods(name)  # one worker process, on a node, at its own address
            assert pod.spec.node_name in NODES, pod.spec
            assert ipaddress.ip_address(pod.status.pod_ip) in runtime.network.subnet, pod.status
        assert all(first.values())

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

    # the same functions on the local platform (processes, no Kubernetes) answer the same
    local_home = tmp_path / "local"
    assert cli("--home", str(local_home), "backbone", "import", BACKBONE, "--from", str(tiny_dense_dir)).returncode == 0
    with PlatformProcess(local_home) as local, ApiClient(local.url, local.admin_key) as api:
        local_client = openai.OpenAI(base_url=f"{local.url}/v1", api_key=local.admin_key)
        for name in ("alpha", "beta"):
            api.deploy({"name": name, "backbone": BACKBONE}, tiny_adapter_dir)
            assert complete(local_client, name) == first[name]
