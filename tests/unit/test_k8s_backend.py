"""The function pod the Kubernetes backend builds, from the template the real chart renders: pure, no API server.

What only an API server can say (placement, readiness, failures, adoption, garbage collection, RBAC) is tested against
a real one in tests/integration/k8s/. The JSON-schema check here is a quick first net: the real server refuses things
it accepts (tests/integration/k8s/test_k8s_api_validation.py shows which).
"""

import json
import re
from pathlib import Path

import kubernetes_validate
import msgspec
import pytest
import yaml

helm = pytest.importorskip("helm_python")
k8s = pytest.importorskip("kubernetes.client")

from lorafaas.errors import Forbidden, InvalidInput  # noqa: E402
from lorafaas.function_runtime.messages import WorkerSpec  # noqa: E402
from lorafaas.platform.adapter_access import AdapterAccess  # noqa: E402
from lorafaas.platform.backends import Backend  # noqa: E402
from lorafaas.platform.backends.function_pod import (  # noqa: E402
    AdapterSource,
    build_function_pod,
    label_value,
    pod_name,
    template_owner,
)
from lorafaas.platform.backends.kubernetes import KubernetesBackend, KubernetesConfig  # noqa: E402
from lorafaas.platform.backends.pod_status import ANNOTATION_INSTANCE_ID, ANNOTATION_SPEC, pod_failure  # noqa: E402

CHART = Path(__file__).resolve().parents[2] / "manifests" / "charts" / "lorafaas"
KUBERNETES_VERSION = "1.30"
NAMESPACE = "lf"
TEMPLATE_UID = "3f1c2a4e-0000-4000-8000-000000000001"
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
SERIALIZER = k8s.ApiClient()


def rendered_template() -> tuple[k8s.V1Pod, k8s.V1OwnerReference]:
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(name="lorafaas", namespace=NAMESPACE, is_install=True)
    data = yaml.safe_load(rendered["lorafaas/templates/function-pod-template.yaml"])
    data["metadata"]["uid"] = TEMPLATE_UID
    config_map = SERIALIZER.deserialize(json.dumps(data), "V1ConfigMap", None)
    pod = SERIALIZER.deserialize(json.dumps(yaml.safe_load(config_map.data["pod.yaml"])), "V1Pod", None)
    return pod, template_owner(config_map)


def worker_spec(function: str = "pirate") -> WorkerSpec:
    return WorkerSpec(function=function, instance_id=f"{function}-abc123", socket_path="tcp://0.0.0.0:9000",
                      model_dir="/var/lib/lorafaas/models/smollm2-135m", adapter_dir="/var/lib/lorafaas/adapters/ab",
                      daemon_socket="/var/lib/lorafaas/run/smollm2-135m@cpu.sock")


def build(spec: WorkerSpec, nodes: list[str], adapter_source: AdapterSource | None = None) -> dict:
    template, owner = rendered_template()
    pod = build_function_pod(template, owner, spec, namespace=NAMESPACE, release="lorafaas",
                             backbone="smollm2-135m", nodes=nodes, worker_port=9000, adapter_source=adapter_source)
    body = SERIALIZER.sanitize_for_serialization(pod)
    kubernetes_validate.validate(body, KUBERNETES_VERSION, strict=True)
    return body


def test_the_backend_satisfies_the_protocol_the_node_agent_types_against(tmp_path: Path) -> None:
    config = KubernetesConfig(namespace=NAMESPACE, release="lorafaas", pod_template="t", home=tmp_path)
    backend = KubernetesBackend(config, core=k8s.CoreV1Api(SERIALIZER))  # never called here
    assert isinstance(backend, Backend)
    assert backend.zygote_pid is None  # no library pool: the node agent skips it
    assert backend.stop_daemon("smollm2-135m") is False  # the DaemonSet's daemons are not ours to stop


def test_a_function_pod_is_the_template_with_identity_worker_and_owner() -> None:
    spec = worker_spec()
    body = build(spec, ["node-a"])
    labels = body["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == "function"
    assert labels["app.kubernetes.io/instance"] == "lorafaas"
    assert labels["lorafaas.io/function"] == "pirate" and labels["lorafaas.io/backbone"] == "smollm2-135m"
    assert body["metadata"]["name"] == "lorafaas-fn-pirate-abc123"
    assert body["metadata"]["annotations"][ANNOTATION_INSTANCE_ID] == spec.instance_id
    assert msgspec.json.decode(body["metadata"]["annotations"][ANNOTATION_SPEC], type=WorkerSpec) == spec
    assert body["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "ConfigMap", "name": "lorafaas-function-pod", "uid": TEMPLATE_UID,
         "controller": True, "blockOwnerDeletion": False}
    ]
    worker = body["spec"]["containers"][0]
    assert worker["args"] == [msgspec.json.encode(spec).decode()]
    assert worker["ports"] == [{"name": "worker", "containerPort": 9000, "protocol": "TCP"}]
    assert worker["readinessProbe"]["tcpSocket"] == {"port": "worker"}
    assert body["spec"]["restartPolicy"] == "Never"
    assert worker["image"] == "lorafaas/function:0.1.0"
    assert body["spec"]["automountServiceAccountToken"] is False
    # of the home only what this worker reads, read-only: its daemon's socket directory, backbone entry and adapter
    assert worker["volumeMounts"] == [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "home", "mountPath": "/var/lib/lorafaas/run", "subPath": "run", "readOnly": True},
        {"name": "home", "mountPath": "/var/lib/lorafaas/models/smollm2-135m", "subPath": "models/smollm2-135m",
         "readOnly": True},
        {"name": "home", "mountPath": "/var/lib/lorafaas/adapters/ab", "subPath": "adapters/ab", "readOnly": True},
    ]


@pytest.mark.parametrize("nodes", [["node-a"], ["node-a", "node-b"], ["node-c", "node-a", "node-b"]])
def test_placement_is_one_node_selector_term_per_serving_node(nodes: list[str]) -> None:
    """The API server takes one value per `matchFields` requirement: terms (ORed) carry one node each."""
    terms = build(worker_spec(), nodes)["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                     for node in sorted(nodes)]


@pytest.mark.parametrize("function", ["Pirate", "a b", "x" * 70, "-odd-", "ünïcode"])
def test_names_and_labels_stay_valid_whatever_the_function_is_called(function: str) -> None:
    body = build(worker_spec(function), ["node-a"])
    name = body["metadata"]["name"]
    assert DNS_LABEL.match(name) and len(name) <= 63
    for value in body["metadata"]["labels"].values():
        assert LABEL_VALUE.match(value) and len(value) <= 63, value
    assert pod_name("lorafaas", f"{function}-1") != pod_name("lorafaas", f"{function}-2")
    assert label_value(function) != label_value(function + "?")


@pytest.mark.parametrize(("field", "value", "message"), [
    ("release", "My Release", "release name"),
    ("release", "x" * 54, "release name"),
    ("namespace", "Team A", "namespace"),
    ("worker_port", 0, "worker port"),
])
def test_the_backend_config_refuses_what_the_api_server_would(field: str, value, message: str) -> None:
    values = {"namespace": NAMESPACE, "release": "lorafaas", "pod_template": "t", field: value}
    with pytest.raises(InvalidInput, match=message):
        KubernetesConfig(**values)


def test_a_fetched_adapter_is_the_pods_own_volume_filled_by_an_init_container_never_the_homes() -> None:
    spec = worker_spec()
    source = AdapterSource("http://lorafaas-controller.lf.svc:80", AdapterAccess(b"k" * 32).token("pirate", "ab"))
    body = build(spec, ["node-a"], source)
    [fetch] = body["spec"]["initContainers"]
    worker = body["spec"]["containers"][0]
    assert fetch["command"] == ["python", "-m", "lorafaas.function_runtime.adapter_fetch"]
    assert fetch["image"] == worker["image"] and fetch["securityContext"] == worker["securityContext"]
    assert {e["name"]: e["value"] for e in fetch["env"]} == {
        "LORAFAAS_ADAPTER_URL": source.url, "LORAFAAS_FUNCTION": "pirate", "LORAFAAS_ADAPTER_DIGEST": "ab",
        "LORAFAAS_ADAPTER_TOKEN": source.token, "HOME": "/tmp"}
    assert fetch["terminationMessagePolicy"] == "FallbackToLogsOnError"  # a refusal is the pod's failure message
    assert fetch["volumeMounts"] == [{"name": "adapter", "mountPath": "/adapter"}]
    assert {"name": "adapter", "emptyDir": {}} in body["spec"]["volumes"]
    assert worker["volumeMounts"] == [  # nothing of the home's adapters: no other function's, not even its own
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "adapter", "mountPath": "/var/lib/lorafaas/adapters/ab", "readOnly": True},
        {"name": "home", "mountPath": "/var/lib/lorafaas/run", "subPath": "run", "readOnly": True},
        {"name": "home", "mountPath": "/var/lib/lorafaas/models/smollm2-135m", "subPath": "models/smollm2-135m",
         "readOnly": True},
    ]


def test_adapter_tokens_open_one_function_and_one_digest_and_survive_a_controller_restart() -> None:
    access = AdapterAccess.from_admin_key("lf_admin_key_of_this_install")
    token = access.token("pirate", "a" * 64)
    access.check("pirate", "a" * 64, f"Bearer {token}")
    # the next controller (same admin key) honours it; another install's does not
    AdapterAccess.from_admin_key("lf_admin_key_of_this_install").check("pirate", "a" * 64, f"Bearer {token}")
    refusals = [(access, "pirate", "b" * 64, f"Bearer {token}"),  # another digest
                (access, "french", "a" * 64, f"Bearer {token}"),  # another function
                (access, "pirate", "a" * 64, "Bearer lf_admin_key_of_this_install"),  # an API key
                (access, "pirate", "a" * 64, None),
                (AdapterAccess.from_admin_key("lf_another_install"), "pirate", "a" * 64, f"Bearer {token}")]
    for checker, function, digest, authorization in refusals:
        with pytest.raises(Forbidden):
            checker.check(function, digest, authorization)
    assert AdapterAccess.from_admin_key(None).token("p", "a") != AdapterAccess.from_admin_key(None).token("p", "a")


def function_pod_status(init_state: dict, phase: str = "Pending") -> k8s.V1Pod:
    def status(name: str, state: dict) -> dict:
        return {"name": name, "ready": False, "restartCount": 0, "image": "i", "imageID": "", "state": state}

    return SERIALIZER.deserialize(json.dumps({
        "metadata": {"name": "lorafaas-fn-pirate-abc123", "labels": {"lorafaas.io/function": "pirate"},
                     "annotations": {ANNOTATION_INSTANCE_ID: "pirate-abc123"}},
        "status": {"phase": phase, "initContainerStatuses": [status("adapter-fetch", init_state)],
                   "containerStatuses": [status("worker", {"waiting": {"reason": "PodInitializing"}})]}}),
        "V1Pod", None)


def test_a_failed_init_container_is_the_pods_failure_with_its_message() -> None:
    refused = {"terminated": {"exitCode": 1, "reason": "Error", "message": "adapter fetch failed: refused\n"}}
    failure = pod_failure(function_pod_status(refused, "Failed"))
    assert failure is not None
    assert (failure.function, failure.reason, failure.exit_code) == ("pirate", "Error", 1)
    assert failure.message == "init container adapter-fetch exited with 1: adapter fetch failed: refused"
    # the image is pulled for the init container first: its pull failure is the launch's, at once
    unpullable = {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}}
    failure = pod_failure(function_pod_status(unpullable))
    assert failure is not None and failure.reason == "ImagePullBackOff"
    assert pod_failure(function_pod_status({"running": {}})) is None  # fetching: still starting
