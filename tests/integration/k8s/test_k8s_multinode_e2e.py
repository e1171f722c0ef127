"""The platform on a three-node cluster on one machine: the real API server, scheduler and garbage collector, the
process kubelet running every function pod as a real worker process on its own loopback address, and the controller
(`lorafaas up --backend kubernetes`, Redis state) as the chart runs it, but as a local process rather than through
`helm install`. Two functions answer the `openai` client; they scale to zero and back; a SIGKILLed function pod and a
deleted node are replaced on the remaining nodes, answering the same.

All "nodes" share this machine, so they share one backbone daemon (on a cluster, each node's agent runs its own);
the node-agent pods report ready when that daemon's socket exists.
"""

from __future__ import annotations

import os
import signal
import subprocess
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
    daemon = subprocess.Popen([sys.executable, "-m", "lorafaas", "--home", str(home), "backbone", "serve", BACKBONE,
                               "--device", "cpu", "--lease-ttl", "30"], stdout=subprocess.DEVNULL,
                              stderr=(tmp_path / "daemon.log").open("wb"), start_new_session=True)
    socket_path = home / "run" / f"{BACKBONE}@cpu.sock"
    platform = None
    try:
        wait_until(socket_path.exists, "the backbone daemon's socket", 120)
        for node in NODES:  # the DaemonSet's pods: ready when their daemon's socket exists
            release.admin.create_namespaced_pod(release.namespace, {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": f"agent-{node}", "labels": {"app.kubernetes.io/instance": RELEASE,
                                                                  "app.kubernetes.io/component": "node-agent"},
                             "annotations": {"lorafaas.io/backbones": BACKBONE}},
                "spec": {"nodeName": node, "automountServiceAccountToken": False, "containers": [{
                    "name": "daemon", "image": "lorafaas/node-agent", "command": ["sleep", "3600"],
                    "readinessProbe": {"exec": {"command": ["test", "-S", str(socket_path)]}}}]},
            })
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

            # lose the node serving beta: its function comes back on another node
            complete(client, "beta")
            [pod] = function_pods(release, "beta")
            lost = pod.spec.node_name
            kubelet.remove_node(lost)
            time.sleep(1)
            assert complete(client, "beta") == first["beta"]
            [again] = function_pods(release, "beta") or [None]
            assert again is not None and again.spec.node_name != lost
    finally:
        if platform is not None:
            platform.stop()
        os.killpg(daemon.pid, signal.SIGTERM)
        daemon.wait(30)
