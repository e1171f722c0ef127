"""Quantities (cpu, memory, size limits) of every type the values schema documents: an integer, a float or a string.

Each values file the schema accepts renders objects the real API server takes (server dry run), and a controller reads
the rendered function pod template and starts: the Python client's models take only strings where the API server
also takes numbers, so a number rendered as is (`cpu: 2`) used to stop the controller at start, over and over.
"""

from __future__ import annotations

import pytest
import yaml
from k8s_env import BACKBONE, NODES, TEMPLATE, Release, dry_run_chart, helm, render_chart

# type -> (the cpu and memory a user writes in a values file, the strings the pod gets)
QUANTITIES = {
    "integer": ("cpu: 2\nmemory: 1073741824", {"cpu": "2", "memory": "1073741824"}),
    "float": ("cpu: 0.5\nmemory: 1.5e9", {"cpu": "0.5", "memory": "1500000000"}),
    "string": ("cpu: 500m\nmemory: 1Gi", {"cpu": "500m", "memory": "1Gi"}),
    "quoted number": ("cpu: '2'\nmemory: '1073741824'", {"cpu": "2", "memory": "1073741824"}),
}


def values_with(quantities: str) -> dict:
    """A user's values file with these quantities in every resources block and size limit."""
    block = "\n".join(f"      {line}" for line in quantities.splitlines())
    resources = f"  resources:\n    requests:\n{block}\n    limits:\n{block}\n"
    memory = yaml.safe_load(quantities)["memory"]
    text = (f"controller:\n{resources}redis:\n{resources}  persistence:\n    size: {memory}\n"
            f"nodeAgent:\n{resources}  shmSizeLimit: {memory}\n"
            f"{resources.replace('  resources:', '  holderResources:')}"
            f"function:\n{resources}  tmpSizeLimit: {memory}\n")
    return helm.values_from_yaml(text)


@pytest.mark.parametrize("kind", QUANTITIES)
def test_every_documented_quantity_type_passes_a_server_dry_run_and_the_controller_reads_it(
        release: Release, kind: str) -> None:
    quantities, expected = QUANTITIES[kind]
    objects = render_chart(release.namespace, values_with(quantities), name="check")
    api = release.plane.api_client()
    dry_run_chart(api, objects, release.namespace)
    template = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("function-pod"))
    release.admin.patch_namespaced_config_map(TEMPLATE, release.namespace, {"data": template["data"]})
    release.add_agent(NODES[0])
    backend = release.backend()
    backend.start()  # reads the template and dry-runs a pod made from it
    pod = backend.pod_template.build_pod(backend.spec("pirate", BACKBONE, None), BACKBONE, [NODES[0]])
    resources = backend.pod_template.to_dict(pod)["spec"]["containers"][0]["resources"]
    assert resources == {"requests": expected, "limits": expected}
    volumes = {v["name"]: v for v in backend.pod_template.to_dict(pod)["spec"]["volumes"]}
    assert volumes["tmp"]["emptyDir"]["sizeLimit"] == expected["memory"]


def test_a_template_edited_by_hand_with_number_quantities_starts_the_controller(release: Release) -> None:
    def numbers(pod: dict) -> None:
        pod["spec"]["containers"][0]["resources"] = {"requests": {"cpu": 0.25, "memory": 536870912},
                                                     "limits": {"cpu": 2, "memory": 2147483648}}

    release.set_template(numbers)
    release.add_agent(NODES[0])
    backend = release.backend()
    backend.start()
    pod = backend.pod_template.build_pod(backend.spec("pirate", BACKBONE, None), BACKBONE, [NODES[0]])
    assert backend.pod_template.to_dict(pod)["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "0.25", "memory": "536870912"}, "limits": {"cpu": "2", "memory": "2147483648"}}
