"""On a real cluster: install the chart, deploy the pirate demo adapter as a function and invoke it through the
gateway. Runs only when KUBECONFIG points at a cluster that can pull the images (LORAFAAS_IMAGE_REGISTRY and
LORAFAAS_IMAGE_TAG say where they are; build them as docs/kubernetes.md shows) and kubectl is on PATH (for the port
forward to the gateway). Nothing here can run without a cluster: no kind or k3s on the CI machine."""

import base64
import os
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "manifests" / "charts" / "lorafaas"

pytestmark = [
    pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason="KUBECONFIG does not point at a Kubernetes cluster"),
    pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is needed for the port forward to the gateway"),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def lorafaas(*args: str, key: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "LORAFAAS_API_KEY": key}
    return subprocess.run(["lorafaas", *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_the_chart_deploys_and_a_function_pod_answers_an_invocation(tmp_path: Path) -> None:
    helm = pytest.importorskip("helm_python")
    from kubernetes import client, config

    config.load_kube_config()
    core = client.CoreV1Api()
    namespace = f"lorafaas-test-{secrets.token_hex(3)}"
    values = {
        "image": {
            "registry": os.environ.get("LORAFAAS_IMAGE_REGISTRY", ""),
            "tag": os.environ.get("LORAFAAS_IMAGE_TAG", ""),
        },
        "controller": {"deviceBudget": "4G"},
    }
    with helm.Config(namespace=namespace) as cluster:
        cluster.install(
            CHART, "lorafaas", values, namespace=namespace, create_namespace=True, wait="watcher", timeout=900
        )
        forward = None
        try:
            secret = core.read_namespaced_secret("lorafaas-admin-key", namespace)
            key = base64.b64decode(secret.data["admin-key"]).decode()
            port = free_port()
            forward = subprocess.Popen(
                ["kubectl", "-n", namespace, "port-forward", "svc/lorafaas-controller", f"{port}:80"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while (listed := lorafaas("--url", url, "list", key=key, timeout=30)).returncode != 0:
                assert time.monotonic() < deadline, listed.stderr
                time.sleep(1)
            deployed = lorafaas(
                "--url",
                url,
                "deploy",
                "pirate",
                "--adapter",
                str(ROOT / "examples/adapters/pirate"),
                "--backbone",
                "smollm2-135m",
                key=key,
            )
            assert deployed.returncode == 0, deployed.stderr
            invoked = lorafaas(
                "--url", url, "invoke", "pirate", "Tell me about the ocean.", "--max-tokens", "16", key=key
            )
            assert invoked.returncode == 0, invoked.stderr
            assert invoked.stdout.strip()
            pods = core.list_namespaced_pod(namespace, label_selector="lorafaas.io/function=pirate").items
            assert pods and pods[0].metadata.owner_references[0].kind == "ConfigMap"
            assert pods[0].status.phase == "Running"
        finally:
            if forward is not None:
                forward.terminate()
                forward.wait(10)
            cluster.uninstall("lorafaas", wait="watcher", timeout=300, ignore_not_found=True)
            core.delete_namespace(namespace)
