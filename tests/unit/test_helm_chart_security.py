"""The chart's hardening: values checked by values.schema.json, every container's securityContext and resources, the
Pod Security level docs/kubernetes.md states, the optional PodDisruptionBudget and ServiceMonitor, and checkov on
every documented render with no failed check beyond the justified list in docs/kubernetes.md."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

helm = pytest.importorskip("helm_python")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "manifests" / "charts" / "lorafaas"
DOC = ROOT / "docs" / "kubernetes.md"
WORKLOADS = ("Deployment", "DaemonSet", "StatefulSet")
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


def render(values: dict | None = None) -> list[dict]:
    with helm.Chart.load(CHART) as loaded:
        rendered = loaded.render(values=values, name="lorafaas", namespace="lf", is_install=True)
    return [doc for path, text in sorted(rendered.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def pod_specs(objects: list[dict]) -> dict[str, dict]:
    """Every pod the release runs: the workloads' templates and the function pod template."""
    pods = {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objects if o["kind"] in WORKLOADS}
    for o in objects:
        if o["kind"] == "ConfigMap" and "pod.yaml" in o.get("data", {}):
            pods["function"] = yaml.safe_load(o["data"]["pod.yaml"])["spec"]
    return pods


@pytest.mark.parametrize(("values", "message"), [
    ({"devise": "cpu"}, "devise"),  # a typo is an error, not a silently ignored key
    ({"device": "gpu"}, "device"),
    ({"securityContext": {"runAsUser": 0}}, "runAsUser"),
    ({"controller": {"replicas": 2}}, "replicas"),
    ({"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
    ({"function": {"resources": {"limits": {"memory": "lots"}}}}, "memory"),
    ({"nodeAgent": {"backbones": ["Not A Name"]}}, "backbones"),
    ({"home": {"runHostPath": "var/run/lorafaas"}}, "runHostPath"),
])
def test_values_the_schema_refuses_name_the_field(values: dict, message: str) -> None:
    with pytest.raises(helm.HelmError, match=message):
        render(values)


@pytest.mark.parametrize("values_name", [None, "values-cpu.yaml", "values-gpu.yaml"])
def test_every_container_is_hardened_and_has_cpu_and_memory_requests_and_limits(values_name) -> None:
    values = yaml.safe_load((CHART / values_name).read_text()) if values_name else None
    for name, pod in pod_specs(render(values)).items():
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            where = f"{name}/{container['name']}"
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, where
            assert context["readOnlyRootFilesystem"] is True, where
            assert context["capabilities"]["drop"] == ["ALL"], where
            if container["name"] == "prepare-home":  # the one root container: chown of a hostPath home
                assert context["capabilities"]["add"] == ["CHOWN"] and context["runAsUser"] == 0
            else:
                assert "add" not in context["capabilities"] and context.get("runAsUser", 1) != 0, where
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"][kind]), f"{where} {kind}"


def test_with_a_claim_for_the_home_every_pod_meets_pod_security_restricted() -> None:
    """docs/kubernetes.md: `restricted` with home.existingClaim, on CPUs or GPUs (no host namespace: descriptors
    cross the daemon's socket); the default hostPath home needs `privileged` (hostPath volumes, the root init
    container)."""
    claim = {"home": {"existingClaim": "lorafaas-home"}}
    gpu = {**yaml.safe_load((CHART / "values-gpu.yaml").read_text()), **claim}
    claimed = [*pod_specs(render(claim)).items(), *pod_specs(render(gpu)).items()]
    for name, pod in claimed:
        assert not {"hostIPC", "hostPID", "hostNetwork"} & {k for k, v in pod.items() if v}, name
        assert {key for v in pod.get("volumes", []) for key in v if key != "name"} <= RESTRICTED_VOLUMES, name
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            context = container["securityContext"]
            assert not context.get("privileged") and context["runAsNonRoot"] is True, name
            assert context["allowPrivilegeEscalation"] is False and context["capabilities"]["drop"] == ["ALL"]
    default = pod_specs(render())
    assert any("hostPath" in v for v in default["lorafaas-node-agent"]["volumes"])
    shared = pod_specs(render({"home": {"existingClaim": "lorafaas-home", "runHostPath": "/var/run/lorafaas"}}))
    assert [name for name, pod in shared.items() if any("hostPath" in v for v in pod.get("volumes", []))] == [
        name for name in shared if name != "lorafaas-controller" and "redis" not in name]  # privileged, as documented


def test_optional_pod_disruption_budget_and_service_monitor() -> None:
    objects = render({"podDisruptionBudget": {"enabled": True, "minAvailable": 2},
                      "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}})
    [budget] = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    kubernetes_validate.validate(budget, "1.30", strict=True)
    assert budget["spec"]["minAvailable"] == 2
    assert budget["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "function"
    [monitor] = [o for o in objects if o["kind"] == "ServiceMonitor"]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["port"] == "http"
    assert endpoint["bearerTokenSecret"] == {"name": "lorafaas-admin-key", "key": "admin-key"}
    assert not {"PodDisruptionBudget", "ServiceMonitor"} & {o["kind"] for o in render()}


def justified_checks() -> set[str]:
    """The checkov ids docs/kubernetes.md lists, with a reason each, under "checkov"."""
    section = DOC.read_text().split("### checkov", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(CKV\w+)` \|", section, flags=re.MULTILINE))


def checkov_binary() -> str | None:
    return os.environ.get("LORAFAAS_CHECKOV") or shutil.which("checkov")


DIGEST = "sha256:" + "0" * 64
# Every render docs/kubernetes.md documents, and one with every image pinned by digest (CKV_K8S_43's remedy)
DOCUMENTED_RENDERS = {
    "default": None,
    "values-cpu": "values-cpu.yaml",
    "shared claim": {"home": {"existingClaim": "lorafaas-home", "runHostPath": "/var/run/lorafaas"}},
    "values-gpu": "values-gpu.yaml",
    "digests": {"image": {name: {"repository": f"lorafaas/{repository}", "digest": DIGEST}
                          for name, repository in [("gateway", "gateway"), ("nodeAgent", "node-agent"),
                                                   ("function", "function")]},
                "redis": {"image": {"repository": "redis", "tag": f"7.2-alpine@{DIGEST}"}}},
}


@pytest.mark.skipif(checkov_binary() is None and os.environ.get("LORAFAAS_REQUIRE_CHECKOV") != "1",
                    reason="checkov is not installed (it needs its own venv: see .ci/run)")
@pytest.mark.parametrize("render_name", DOCUMENTED_RENDERS)
def test_checkov_fails_only_the_justified_checks_on_every_documented_render(render_name: str, tmp_path: Path) -> None:
    values = DOCUMENTED_RENDERS[render_name]
    if isinstance(values, str):
        values = yaml.safe_load((CHART / values).read_text())
    objects = render(values)
    pod = yaml.safe_load(next(o for o in objects if o["kind"] == "ConfigMap"
                              and "pod.yaml" in o.get("data", {}))["data"]["pod.yaml"])
    pod["metadata"].update(name="lorafaas-fn-template", namespace="lf")  # what the controller creates, too
    (tmp_path / "render.yaml").write_text(yaml.safe_dump_all([*objects, pod]))
    binary = checkov_binary()
    assert binary is not None, "LORAFAAS_REQUIRE_CHECKOV=1 but no checkov (LORAFAAS_CHECKOV or PATH)"
    result = subprocess.run([binary, "-f", str(tmp_path / "render.yaml"), "--framework", "kubernetes",
                             "--output", "json", "--quiet", "--compact", "--skip-download"],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "BC_SKIP_MAPPING": "TRUE"})
    report = json.loads(result.stdout)
    failed = {(c["check_id"], c["resource"]) for c in report["results"]["failed_checks"]}
    assert report["summary"]["passed"] > 300
    assert {check for check, _ in failed} <= justified_checks(), sorted(failed)
    assert not {"CKV_K8S_17", "CKV_K8S_18", "CKV_K8S_19"} & {check for check, _ in failed}  # host PID, IPC, network
    if render_name == "digests":
        assert "CKV_K8S_43" not in {check for check, _ in failed}, sorted(failed)
