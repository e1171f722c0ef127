"""The chart installed as the helm end-to-end test installs it (test_k8s_helm_e2e.py: its values, on its
`helm_cluster`), for the tests that then do something to a running release: upgrade it, lose a machine."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from k8s_env import CHART, wait_until
from test_k8s_helm_e2e import NODES, RELEASE, HelmCluster

helm = pytest.importorskip("helm_python")

BACKBONE = "tiny-dense"  # imported by hand into the shared home: a release ready in seconds, not a SmolLM2 per node
SMALL = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}}

VALUES = {
    "home": {"existingClaim": "lorafaas-home", "runHostPath": "/var/run/lorafaas"},
    "controller": {"resources": SMALL},
    "nodeAgent": {"backbones": [BACKBONE], "importBuiltin": False, "resources": SMALL},
    "function": {"resources": SMALL},
    "redis": {"resources": SMALL},
}


@pytest.fixture
def shared_home(helm_cluster: HelmCluster, tmp_path: Path) -> Iterator[Path]:
    """The release's `home.existingClaim` (made here, as a user makes one) bound to a ReadWriteMany volume whose NFS
    server is this machine (the process kubelet mounts its path); the directory on this machine."""
    home = tmp_path / "nfs" / "home"
    home.mkdir(parents=True)
    volume = f"{helm_cluster.namespace}-home"
    helm_cluster.core.create_persistent_volume({"metadata": {"name": volume}, "spec": {
        "capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"], "persistentVolumeReclaimPolicy": "Retain",
        "claimRef": {"namespace": helm_cluster.namespace, "name": "lorafaas-home"},
        "nfs": {"server": "127.0.0.1", "path": str(home)}}})
    helm_cluster.core.create_namespaced_persistent_volume_claim(helm_cluster.namespace, {
        "metadata": {"name": "lorafaas-home"},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}})
    try:
        yield home
    finally:
        helm_cluster.core.delete_persistent_volume(volume)


@dataclass
class Installed:
    url: str  # the gateway's Service
    admin_key: str
    controller: object  # its pod
    redis: object


def install(cluster: HelmCluster, home: Path, cli, tiny_dense_dir: Path, values: dict = VALUES) -> Installed:
    """The backbone imported into the shared `home`, the chart installed, every pod ready."""
    assert cli("--home", str(home), "backbone", "import", BACKBONE, "--from",
               str(tiny_dense_dir)).returncode == 0
    helm_apply(cluster, values, upgrade=False)
    wait_until(lambda: len(cluster.ready("node-agent")) == len(NODES), "a ready node agent on every node", 180,
               explain=cluster.account)
    [controller] = wait_until(lambda: cluster.ready("controller"), "the controller ready", 180,
                              explain=cluster.account)
    [redis] = wait_until(lambda: cluster.ready("redis"), "Redis ready", 60)
    service = cluster.core.read_namespaced_service(f"{RELEASE}-controller", cluster.namespace)
    secret = cluster.core.read_namespaced_secret(f"{RELEASE}-admin-key", cluster.namespace)
    return Installed(f"http://{service.spec.cluster_ip}:{service.spec.ports[0].port}",
                     base64.b64decode(secret.data["admin-key"]).decode(), controller, redis)


def helm_apply(cluster: HelmCluster, values: dict, upgrade: bool) -> None:
    with helm.Config(kubeconfig_path=str(cluster.plane.kubeconfig), namespace=cluster.namespace) as config:
        apply = config.upgrade if upgrade else config.install
        release = apply(str(CHART), RELEASE, values, namespace=cluster.namespace)
    assert release["status"] == "deployed", {k: v for k, v in release.items() if k != "manifest"}
