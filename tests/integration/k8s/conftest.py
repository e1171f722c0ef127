"""Fixtures of the Kubernetes tests: the control plane (one per session) and the fake kubelet with three nodes,
and `release`, a namespace of the test's own (see k8s_env.py). Without the binaries the tests skip, unless
LORAFAAS_REQUIRE_K8S=1 (CI), where they fail."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

k8s = pytest.importorskip("kubernetes.client")

from k8s_env import BACKBONE, NODES, PROCESS_NODE, UNPULLABLE, Release, require_process_kubelet  # noqa: E402

from tests.support.fake_kubelet import FakeKubelet, StatusRuntime  # noqa: E402
from tests.support.k8s_cluster import ControlPlane, default_bin_dir, missing_binaries  # noqa: E402
from tests.support.process_kubelet import ProcessRuntime  # noqa: E402


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    bin_dir = default_bin_dir()
    missing = missing_binaries(bin_dir)
    if missing:
        reason = f"no Kubernetes control plane to test against (missing {', '.join(missing)}): run " \
                 "scripts/k8s-testenv.sh build, or set LORAFAAS_K8S_BIN"
        if os.environ.get("LORAFAAS_REQUIRE_K8S") == "1":
            pytest.fail(f"{reason}; LORAFAAS_REQUIRE_K8S=1 forbids skipping", pytrace=False)
        pytest.skip(reason)
    plane = ControlPlane(bin_dir, tmp_path_factory.mktemp("k8s"))
    plane.start()
    yield plane
    plane.stop()


@pytest.fixture(scope="session")
def kubelet(control_plane: ControlPlane) -> Iterator[FakeKubelet]:
    kubelet = FakeKubelet(control_plane.api_client(), list(NODES),
                          runtime=StatusRuntime(unpullable=lambda image: UNPULLABLE in image))
    kubelet.start()
    yield kubelet
    kubelet.stop()



@pytest.fixture
def release(control_plane: ControlPlane, kubelet: FakeKubelet, tmp_path: Path) -> Iterator[Release]:
    namespace = f"lf-{secrets.token_hex(3)}"
    admin = k8s.CoreV1Api(control_plane.api_client())
    admin.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    control_plane.wait_default_service_account(namespace)
    (tmp_path / "models" / BACKBONE).mkdir(parents=True)
    release = Release(control_plane, kubelet, namespace, tmp_path)
    release.install()
    yield release
    for backend in release.backends:
        close = getattr(backend, "stop", None)
        if close is not None:
            close()
    admin.delete_namespace(namespace, body=k8s.V1DeleteOptions(grace_period_seconds=0))


@pytest.fixture
def process_kubelet(release: Release, tmp_path: Path) -> Iterator[tuple[FakeKubelet, ProcessRuntime]]:
    """One more node, PROCESS_NODE, whose pods run as processes (tests/support/process_kubelet.py)."""
    require_process_kubelet()
    runtime = ProcessRuntime(release.plane.api_client(), tmp_path)
    kubelet = FakeKubelet(release.plane.api_client(), [PROCESS_NODE], runtime=runtime)
    kubelet.start()
    yield kubelet, runtime
    kubelet.stop()
    kubelet.remove_node(PROCESS_NODE)
