"""The platform on a three-node cluster on one machine: the real API server, scheduler and garbage collector, the
process kubelet running every function pod as a real worker process on its own loopback address, and the controller
(`lorafaas up --backend kubernetes`, Redis state) as the chart runs it, but as a local process rather than through
`helm install`. Two functions answer the `openai` client as the local platform does; they scale to zero and back; a
SIGKILLed function pod and a lost node are replaced on the remaining nodes, and a SIGKILLed node agent is restarted,
all answering the same.

All "nodes" share this machine, so they share one backbone daemon (on a cluster, each node's agent runs its own);
the first node's agent pod runs it, and every agent pod reports ready when its socket exists.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from k8s_env import RELEASE, TEMPLATE, Release, wait_until

from lorafaas.platform.api_client import ApiClient
from lorafaas.testing.fake_kubelet import FakeKubelet
from lorafaas.testing.platform_process import PlatformProcess
from lorafaas.testing.process_kubelet import ProcessRuntime

openai = pytest.importorskip("openai")

NODES = ("proc-1", "proc-2", "proc-3")
BACKBONE = "tiny-dense"
PROMPT = "The ocean is"


@pytest.fixture
def cluster(release: Release, tmp_path: Path) -> Iterator[tuple[FakeKubelet, ProcessRuntime]]:
    runtime = ProcessRuntime(tmp_path)
    kubelet = FakeKubelet(release.plane.api_client(), list(NODES), runtime=runtime)
    kubelet.start()
    yield kubelet, runtime
    kubelet.stop()
    for node in list(kubelet.nodes):
        kubelet.remove_node(node)


def function_pods(release: Release, function: str) -> list:
    return [p for p in release.function_pods() if p.metadata.labels.get("lorafaas.io/function") == function
            and p.metadata.deletion_timestamp is None and p.status.phase == "Running"]


def complete(client, function: str) -> str:
    reply = client.completions.create(model=function, prompt=PROMPT, max_tokens=6, temperature=0)
    return reply.choices[0].text


def test_two_functions_on_three_process_nodes_scale_survive_kills_and_a_lost_node(
        release: Release, cluster, tmp_path: Path, tiny_dense_dir: Path, tiny_adapter_dir: Path, cli,
        redis_url: str) -> None:
    kubelet, runtime = cluster
    home = tmp_path / "home"
    assert cli("--home", str(home), "backbone", "import", BACKBONE, "--from", str(tiny_dense_dir)).returncode == 0
    socket_path = home / "run" / f"{BACKBONE}@cpu.sock"
    platform = None
    try:
        serve = [sys.executable, "-m", "lorafaas", "--home", str(home), "backbone", "serve", BACKBONE, "--device",
                 "cpu", "--lease-ttl", "30"]
        for node in NODES:  # the DaemonSet's pods: the first runs the daemon; all are ready when its socket exists
            release.admin.create_namespaced_pod(release.namespace, {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": f"agent-{node}", "labels": {"app.kubernetes.io/instance": RELEASE,
                                                                  "app.kubernetes.io/component": "node-agent"},
                             "annotations": {"lorafaas.io/backbones": BACKBONE}},
                "spec": {"nodeName": node, "automountServiceAccountToken": False, "containers": [{
                    "name": "daemon", "image": "lorafaas/node-agent",
                    "command": serve if node == NODES[0] else ["sleep", "3600"],
                    "readinessProbe": {"exec": {"command": ["test", "-S", str(socket_path)]}}}]},
            })
        wait_until(socket_path.exists, "the backbone daemon's socket", 120)
        env = {"KUBECONFIG": str(release.plane.kubeconfig), "POD_NAMESPACE": release.namespace,
               "LORAFAAS_RELEASE": RELEASE, "LORAFAAS_POD_TEMPLATE": TEMPLATE, "LORAFAAS_WORKER_LISTEN": "pod-ip"}
        platform = PlatformProcess(home, extra_args=("--backend", "kubernetes", "--state", redis_url),
                                   env=env).start()
        client = openai.OpenAI(base_url=f"{platform.url}/v1", api_key=platform.admin_key, max_retries=2)
        with ApiClient(platform.url, platform.admin_key) as api:
            for name in ("alpha", "beta"):
                api.deploy({"name": name, "backbone": BACKBONE, "keep_alive_s": 5}, tiny_adapter_dir)
            first = {}
            for name in ("alpha", "beta"):
                first[name] = complete(client, name)
                [pod] = function_pods(release, name)  # one worker process, on a node, at its own address
                assert pod.spec.node_name in NODES and pod.status.pod_ip.startswith("127."), pod.status
            assert all(first.values())

            # scale to zero: idle past keep-alive, the pods go; the next request starts one again
            wait_until(lambda: not release.function_pods(), "every function pod retired after keep-alive", 60)
            assert complete(client, "alpha") == first["alpha"]

            # SIGKILL the function pod's worker process: the pod fails, a new one serves
            [pod] = function_pods(release, "alpha")
            [pid] = runtime.pids(pod.metadata.uid).values()
            os.killpg(pid, signal.SIGKILL)
            wait_until(lambda: release.pod(pod.metadata.name) is None
                       or release.pod(pod.metadata.name).status.phase == "Failed", "the killed pod failed", 30)
            assert complete(client, "alpha") == first["alpha"]
            assert any(f["reason"] in ("Error", "exited unexpectedly") for f in api.describe("alpha")["failures"])

            # lose the node serving beta (not the one running the shared daemon, which stays cordoned): beta
            # comes back on another node
            release.admin.patch_node(NODES[0], {"spec": {"unschedulable": True}})
            for pod in function_pods(release, "beta"):
                release.admin.delete_namespaced_pod(pod.metadata.name, release.namespace)
            wait_until(lambda: not function_pods(release, "beta"), "beta's pod gone")
            complete(client, "beta")
            [pod] = function_pods(release, "beta")
            lost = pod.spec.node_name
            kubelet.remove_node(lost)
            time.sleep(1)
            assert complete(client, "beta") == first["beta"]
            [again] = function_pods(release, "beta") or [None]
            assert again is not None and again.spec.node_name != lost

            # SIGKILL the node agent's daemon: the kubelet restarts it; the functions keep serving
            agent = release.pod(f"agent-{NODES[0]}")
            [daemon_pid] = runtime.pids(agent.metadata.uid).values()
            os.killpg(daemon_pid, signal.SIGKILL)
            wait_until(lambda: release.pod(f"agent-{NODES[0]}").status.container_statuses[0].restart_count == 1,
                       "the agent's daemon restarted", 60)
            assert complete(client, "alpha") == first["alpha"]
            assert complete(client, "beta") == first["beta"]
        platform.stop()
        platform = None

        # the same functions on the local platform (processes, no Kubernetes) answer the same
        local_home = tmp_path / "local"
        assert cli("--home", str(local_home), "backbone", "import", BACKBONE, "--from",
                   str(tiny_dense_dir)).returncode == 0
        with PlatformProcess(local_home) as local, ApiClient(local.url, local.admin_key) as api:
            api.deploy({"name": "alpha", "backbone": BACKBONE}, tiny_adapter_dir)
            local_client = openai.OpenAI(base_url=f"{local.url}/v1", api_key=local.admin_key)
            assert complete(local_client, "alpha") == first["alpha"]
    finally:
        if platform is not None:
            platform.stop()
