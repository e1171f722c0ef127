"""A function pod gets its adapter from the controller, not from a volume: the pod the backend builds runs on the
process kubelet (its init container, then its worker container, as processes in the pod's namespaces) against a real
`lorafaas up` serving the adapter route on the pod network's host address."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest
from k8s_env import PROCESS_NODE, TEMPLATE, Release, wait_until

from lorafaas.formats.model_store import ModelStore
from lorafaas.function_runtime.messages import WorkerSpec
from lorafaas.platform.adapter_access import AdapterAccess
from lorafaas.platform.backends.kubernetes import KubernetesBackend, KubernetesConfig
from lorafaas.platform.backends.pod_status import pod_failure
from lorafaas.testing.platform_process import PlatformProcess

k8s = pytest.importorskip("kubernetes.client")

HOME = Path("/var/lib/lorafaas")  # the chart's home.mountPath
# the worker container, in place of the real worker: the digest of what it finds at its adapter_dir, and whether it
# could write there
WORKER = """
import hashlib, pathlib, sys
adapter = pathlib.Path(sys.argv[1])
digest = hashlib.sha256()
for name in ("adapter_config.json", "adapter_model.safetensors"):
    digest.update((adapter / name).read_bytes())
try:
    (adapter / "extra").write_text("x")
    writable = True
except OSError:
    writable = False
print("adapter", digest.hexdigest(), "writable" if writable else "read-only")
"""


@pytest.fixture
def platform(tmp_path: Path, tiny_dense_dir: Path):
    home = tmp_path / "controller-home"
    ModelStore(home / "models").import_dir("tiny-dense", tiny_dense_dir)
    with PlatformProcess(home, extra_args=("--host", "0.0.0.0")) as running:
        yield running


def run_function_pod(release: Release, runtime, platform: PlatformProcess, instance_id: str, digest: str
                     ) -> k8s.V1Pod:
    url = f"http://{runtime.network.gateway}:{platform.port}"  # the controller as a pod reaches it
    backend = KubernetesBackend(
        KubernetesConfig(namespace=release.namespace, release="lorafaas", pod_template=TEMPLATE, home=HOME,
                         adapter_url=url),
        core=release.admin, adapter_access=AdapterAccess.from_admin_key(platform.admin_key))
    spec = WorkerSpec(function="alpha", instance_id=instance_id, socket_path="tcp://0.0.0.0:9000",
                      model_dir=str(HOME / "models" / "tiny-dense"), adapter_dir=str(HOME / "adapters" / digest))
    pod = backend.pod_template.build_pod(spec, "tiny-dense", [PROCESS_NODE])
    worker = pod.spec.containers[0]
    worker.command, worker.args, worker.readiness_probe = [sys.executable, "-c", WORKER], [spec.adapter_dir], None
    release.admin.create_namespaced_pod(release.namespace, pod)
    name = pod.metadata.name
    return wait_until(lambda: (p := release.pod(name)) is not None and p.status.phase in ("Succeeded", "Failed")
                      and p, f"pod {name} to end", 120)


def test_a_pod_fetches_its_adapter_read_only_and_a_damaged_one_fails_its_start_with_the_reason(
        release: Release, process_kubelet, platform: PlatformProcess, tmp_path: Path, tiny_adapter_dir: Path) -> None:
    _, runtime = process_kubelet
    with platform.client() as admin:
        digest = admin.deploy({"name": "alpha", "backbone": "tiny-dense"}, tiny_adapter_dir)["adapter_digest"]

    done = run_function_pod(release, runtime, platform, "alpha-0", digest)
    assert done.status.phase == "Succeeded", done.status
    log = (tmp_path / f"{done.metadata.name}.worker.log").read_text()
    assert f"adapter {digest} read-only" in log  # the digest's bytes, in the pod's own volume, not writable

    stored = platform.home / "adapters" / digest / "adapter_model.safetensors"
    data = bytearray(stored.read_bytes())
    data[0] ^= 0xFF  # the controller's copy damaged on its disk
    stored.write_bytes(bytes(data))
    assert hashlib.sha256(stored.read_bytes()).hexdigest() != digest
    damaged = run_function_pod(release, runtime, platform, "alpha-1", digest)
    assert damaged.status.phase == "Failed"
    failure = pod_failure(damaged)
    assert failure is not None and f"not to the deployed digest {digest[:12]}" in failure.message, failure
    assert "adapter-fetch" in failure.message
    assert not (tmp_path / f"{damaged.metadata.name}.worker.log").exists()  # the worker never started
