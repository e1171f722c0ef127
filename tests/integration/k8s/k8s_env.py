"""Helpers for the Kubernetes tests (fixtures in conftest.py): the chart rendered by Helm, and `Release`.

`Release` is a namespace of the test's own holding what the Helm chart installs for the controller (the function pod
template, the ServiceAccount, Role and RoleBinding) and node-agent pods on the nodes the test says serve the backbone;
its `backend()` is a KubernetesBackend authenticated as the chart's service account, so RBAC applies to every call.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

helm = pytest.importorskip("helm_python")
k8s = pytest.importorskip("kubernetes.client")

from kubernetes.client.exceptions import ApiException  # noqa: E402

from lorafaas.platform.backends.kubernetes import KubernetesBackend, KubernetesConfig  # noqa: E402
from tests.support.fake_kubelet import FakeKubelet  # noqa: E402
from tests.support.k8s_cluster import ControlPlane  # noqa: E402

CHART = Path(__file__).resolve().parents[3] / "manifests" / "charts" / "lorafaas"
NODES = ("node-1", "node-2", "node-3")
PROCESS_NODE = "proc-1"  # the process kubelet's node (fixture `process_kubelet`)
RELEASE = "lorafaas"
TEMPLATE = "lorafaas-function-pod"
SERVICE_ACCOUNT = "lorafaas-controller"
BACKBONE = "smollm2-135m"
UNPULLABLE = "does-not-exist"  # an image whose name holds this cannot be pulled (the kubelet says ImagePullBackOff)
CONTROLLER_OBJECTS = ("ServiceAccount", "Role", "RoleBinding")


def render_chart(namespace: str, values: dict | None = None, name: str = RELEASE) -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values=values, name=name, namespace=namespace, is_install=True)
    return [doc for path, text in sorted(rendered.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def create_object(api: k8s.ApiClient, obj: dict, **kwargs) -> object:
    """Create any object the chart renders (kubernetes.utils maps the kind to its API call)."""
    from kubernetes import utils

    return utils.create_from_dict(api, obj, **kwargs)


NOT_IN_1_20 = {("PodDisruptionBudget", "policy/v1")}  # served from 1.21; the chart documents it


def dry_run_chart(api: k8s.ApiClient, objects: list[dict], namespace: str) -> None:
    """A server-side dry run of every rendered object this API server serves (no ServiceMonitor CRD here)."""
    for obj in objects:
        if (obj["kind"], obj["apiVersion"]) not in NOT_IN_1_20 and obj["kind"] != "ServiceMonitor":
            create_object(api, obj, namespace=namespace, dry_run="All")


@dataclass
class Release:
    """One test's namespace with the chart's controller objects and node agents."""

    plane: ControlPlane
    kubelet: FakeKubelet
    namespace: str
    home: Path
    agents: dict[str, str] = field(default_factory=dict)  # pod name -> node
    backends: list[KubernetesBackend] = field(default_factory=list)

    @property
    def admin(self) -> k8s.CoreV1Api:
        return k8s.CoreV1Api(self.plane.api_client())

    def install(self, values: dict | None = None) -> None:
        """What `helm install` creates for the controller: the pod template and the controller's identity."""
        for obj in render_chart(self.namespace, values):
            if obj["kind"] in CONTROLLER_OBJECTS or obj["metadata"]["name"] == TEMPLATE:
                create_object(self.plane.api_client(), obj, namespace=self.namespace)

    def set_template(self, change) -> None:
        """Edit the function pod template in its ConfigMap: change(pod_dict)."""
        config_map = self.admin.read_namespaced_config_map(TEMPLATE, self.namespace)
        pod = yaml.safe_load(config_map.data["pod.yaml"])
        change(pod)
        self.admin.patch_namespaced_config_map(TEMPLATE, self.namespace, {"data": {"pod.yaml": yaml.safe_dump(pod)}})

    def add_agent(self, node: str, backbones: str = BACKBONE, ready: bool = True) -> str:
        """A node-agent pod bound to `node` (as the DaemonSet controller would make it), serving `backbones`."""
        name = f"{RELEASE}-node-agent-{node}-{secrets.token_hex(2)}"
        pod = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/instance": RELEASE,
                                                  "app.kubernetes.io/name": "lorafaas",
                                                  "app.kubernetes.io/component": "node-agent"},
                         "annotations": {"lorafaas.io/backbones": backbones}},
            "spec": {"nodeName": node, "automountServiceAccountToken": False,
                     "containers": [{"name": "daemon", "image": "lorafaas/node-agent:0.1.0"}]},
        }
        self.admin.create_namespaced_pod(self.namespace, pod)
        self.agents[name] = node
        wait_until(lambda: self._phase(name) == "Running", f"agent {name} running")
        if not ready:
            self.kubelet.patch_status(self.namespace, name, {"conditions": [{"type": "Ready", "status": "False"}]})
        return name

    def backend(self, **config) -> KubernetesBackend:
        """The controller's backend, as the chart's service account (a restarted controller: call it again)."""
        token = self.plane.service_account_token(self.namespace, SERVICE_ACCOUNT)
        core = k8s.CoreV1Api(self.plane.api_client(token))
        backend = KubernetesBackend(
            KubernetesConfig(namespace=self.namespace, release=RELEASE, pod_template=TEMPLATE, home=self.home,
                             **config),
            core=core,
        )
        self.backends.append(backend)
        return backend

    def function_pods(self) -> list[k8s.V1Pod]:
        return self.admin.list_namespaced_pod(
            self.namespace, label_selector="app.kubernetes.io/component=function").items

    def pod(self, name: str) -> k8s.V1Pod | None:
        try:
            return self.admin.read_namespaced_pod(name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _phase(self, name: str) -> str | None:
        pod = self.pod(name)
        return pod.status.phase if pod is not None and pod.status is not None else None


def require_process_kubelet() -> None:
    """Skip without what the process kubelet needs (root, ip, nsenter, unshare); fail instead in CI."""
    from tests.support.process_kubelet import missing_tools

    missing = missing_tools()
    if missing:
        reason = f"the process kubelet needs {', '.join(missing)}"
        if os.environ.get("LORAFAAS_REQUIRE_K8S") == "1":
            pytest.fail(f"{reason}; LORAFAAS_REQUIRE_K8S=1 forbids skipping", pytrace=False)
        pytest.skip(reason)


def wait_until(condition, what: str, timeout_s: float = 60.0, interval_s: float = 0.1,
               explain: Callable[[], str] | None = None):
    """`condition()`'s first truthy result; past the timeout an AssertionError naming `what`, with `explain()`'s
    account of the cluster when given (a CI run's only record of why)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(interval_s)
    account = ""
    if explain is not None:
        try:
            account = f"\n{explain()}"
        except Exception as exc:  # the account is a courtesy: the timeout is the failure to report
            account = f"\n(no account of the cluster: {exc!r})"
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}{account}")


def pod_json(pod: k8s.V1Pod) -> dict:
    return json.loads(json.dumps(k8s.ApiClient().sanitize_for_serialization(pod)))
