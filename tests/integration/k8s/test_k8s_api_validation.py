"""What the real API server refuses, beyond the JSON schemas: server-side dry runs (nothing is created).

The schemas (kubernetes-validate) accept a memory request above its limit, label values with spaces or over 63
characters, uppercase pod names and hostPath `type: Dir`; the server refuses each. So the chart's objects and the
backend's pods are checked here against the server itself.
"""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
import yaml
from k8s_env import BACKBONE, CHART, NODES, Release, dry_run_chart, render_chart
from kubernetes.client.exceptions import ApiException

from lorafaas.errors import InvalidInput

CHART_VALUES = {
    "default": None,
    "cpu": "values-cpu.yaml",
    "gpu": "values-gpu.yaml",
    "everything on": {"serviceMonitor": {"enabled": False}, "podDisruptionBudget": {"enabled": True},
                      "controller": {"ingress": {"enabled": True, "className": "nginx"}}},
}


def defect(name: str):
    def apply(pod: dict) -> None:
        container = pod["spec"]["containers"][0]
        if name == "memory request above its limit":
            container["resources"] = {"requests": {"memory": "4Gi"}, "limits": {"memory": "2Gi"}}
        elif name == "label value with spaces":
            pod["metadata"]["labels"]["lorafaas.io/function"] = "my function"
        elif name == "label value over 63 characters":
            pod["metadata"]["labels"]["lorafaas.io/function"] = "f" * 64
        elif name == "uppercase pod name":
            pod["metadata"]["name"] = "lorafaas-fn-Pirate-abc123"
        elif name == "hostPath type Dir":
            pod["spec"]["volumes"] = [{"name": "home", "hostPath": {"path": "/var/lib/lorafaas", "type": "Dir"}}]
            container["volumeMounts"] = [{"name": "home", "mountPath": "/var/lib/lorafaas"}]
    return apply


DEFECTS = ["memory request above its limit", "label value with spaces", "label value over 63 characters",
           "uppercase pod name", "hostPath type Dir"]


def good_pod(release: Release) -> dict:
    backend = release.backend()
    spec = backend.spec("pirate", BACKBONE, None)
    return backend.pod_template.to_dict(backend.pod_template.build_pod(spec, BACKBONE, list(NODES)))


def dry_run(release: Release, pod: dict) -> None:
    release.admin.create_namespaced_pod(release.namespace, pod, dry_run="All")


@pytest.mark.parametrize("name", DEFECTS)
def test_the_schemas_accept_what_the_api_server_refuses(release: Release, name: str) -> None:
    release.add_agent(NODES[0])
    pod = good_pod(release)
    dry_run(release, copy.deepcopy(pod))  # the backend's pod as it is: accepted
    defect(name)(pod)
    kubernetes_validate.validate(pod, "1.30", strict=True)  # the schema check passes ...
    with pytest.raises(ApiException) as refused:  # ... the server does not
        dry_run(release, pod)
    assert refused.value.status == 422


@pytest.mark.parametrize("function", ["pirate", "Pirate", "my function", "f" * 70])
def test_whatever_the_function_is_called_its_pod_is_accepted(release: Release, function: str) -> None:
    release.add_agent(NODES[0])
    release.add_agent(NODES[1])
    backend = release.backend()
    spec = backend.spec(function, BACKBONE, None)
    dry_run(release, backend.pod_template.to_dict(backend.pod_template.build_pod(spec, BACKBONE, list(NODES))))


def test_a_template_the_server_refuses_stops_the_backend_at_start_with_the_servers_reason(release: Release) -> None:
    release.set_template(defect("memory request above its limit"))
    backend = release.backend()
    with pytest.raises(InvalidInput, match=r"function pod template .* refused .*less than or equal to memory limit"):
        backend.start()


@pytest.mark.parametrize("values_name", CHART_VALUES)
def test_every_object_the_chart_renders_is_accepted_by_the_api_server(release: Release, values_name: str) -> None:
    values = CHART_VALUES[values_name]
    if isinstance(values, str):
        values = yaml.safe_load((CHART / values).read_text())
    objects = render_chart(release.namespace, values, name="check")  # beside the objects the fixture installed
    api = release.plane.api_client()
    dry_run_chart(api, objects, release.namespace)
    template = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("function-pod"))
    pod = yaml.safe_load(template["data"]["pod.yaml"])
    pod["metadata"]["name"] = "check-fn-check"
    dry_run(release, pod)
    assert release.function_pods() == []  # checked, not created
