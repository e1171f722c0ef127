"""The Helm chart rendered and linted by real Helm (helm-python-sdk embeds it as a library), every object validated
against the Kubernetes 1.30 JSON schemas (strict: unknown fields are errors)."""

import shutil
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

helm = pytest.importorskip("helm_python")

CHART = Path(__file__).resolve().parents[2] / "manifests" / "charts" / "lorafaas"
KUBERNETES_VERSION = "1.30"
VALUES_FILES = {"default": None, "cpu": "values-cpu.yaml", "gpu": "values-gpu.yaml"}


def values_of(name: str) -> dict | None:
    file = VALUES_FILES[name]
    return helm.values_from_yaml((CHART / file).read_text()) if file else None


def render(values: dict | None = None, chart: Path = CHART) -> list[dict]:
    with helm.Chart.load(chart) as loaded:
        rendered = loaded.render(values=values, name="lorafaas", namespace="lf", is_install=True)
    return [
        doc
        for path, text in sorted(rendered.items())
        if path.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def admin_key_source(deployment: dict) -> tuple[str, str]:
    """(Secret, key) of the file LORAFAAS_ADMIN_KEY_FILE names in the controller."""
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    path = {e["name"]: e for e in container["env"]}["LORAFAAS_ADMIN_KEY_FILE"]["value"]
    mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert mount["readOnly"] is True
    return volume["secret"]["secretName"], path.rsplit("/", 1)[1]


def function_pod(objects: list[dict]) -> dict:
    return yaml.safe_load(by_kind(objects, "ConfigMap")["lorafaas-function-pod"]["data"]["pod.yaml"])


@pytest.mark.parametrize("values_name", VALUES_FILES)
def test_the_chart_renders_lints_and_every_object_is_valid(values_name: str) -> None:
    values = values_of(values_name)
    objects = render(values)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == [
        "ConfigMap",
        "DaemonSet",
        "Deployment",
        "NetworkPolicy",
        "NetworkPolicy",
        "NetworkPolicy",
        "NetworkPolicy",
        "Role",
        "RoleBinding",
        "Secret",
        "Service",
        "Service",
        "ServiceAccount",
        "StatefulSet",
    ]
    for obj in objects:
        assert kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION
    pod = {**function_pod(objects), "metadata": {"name": "check"}}  # the backend names it
    kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)
    report = helm.lint(CHART, values, strict=True, kube_version=f"v{KUBERNETES_VERSION}.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []  # no warnings (info: "icon is recommended")


def test_lint_fails_a_broken_chart(tmp_path: Path) -> None:
    broken = tmp_path / "lorafaas"
    shutil.copytree(CHART, broken)
    node_agent = broken / "templates" / "node-agent.yaml"
    node_agent.write_text(node_agent.read_text().replace("{{- end }}", "", 1))
    report = helm.lint(broken, None, strict=True)
    assert report["errors"] or any(m["severity"] == 3 for m in report["messages"])


def test_the_controller_has_probes_scrape_annotations_the_admin_key_secret_and_the_kubernetes_backend() -> None:
    objects = render()
    deployment = by_kind(objects, "Deployment")["lorafaas-controller"]
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    env = {e["name"]: e for e in container["env"]}
    assert admin_key_source(deployment) == ("lorafaas-admin-key", "admin-key")  # a file, not an env value
    assert env["LORAFAAS_STATE_URL"]["value"] == "redis://lorafaas-redis:6379/0"
    assert env["LORAFAAS_POD_TEMPLATE"]["value"] in by_kind(objects, "ConfigMap")
    # function pods fetch their adapter from the controller's Service: no volume shared between nodes
    assert env["LORAFAAS_ADAPTER_URL"]["value"] == "http://lorafaas-controller.lf.svc:80"
    assert container["args"][container["args"].index("--backend") + 1] == "kubernetes"
    assert deployment["spec"]["strategy"]["type"] == "Recreate"  # never two controllers creating the same pods
    secret = by_kind(objects, "Secret")["lorafaas-admin-key"]
    assert len(secret["data"]["admin-key"]) >= 32


def test_redis_persists_append_only_or_an_external_url_replaces_it() -> None:
    redis = by_kind(render(), "StatefulSet")["lorafaas-redis"]
    assert redis["spec"]["template"]["spec"]["containers"][0]["args"][1:3] == ["--appendonly", "yes"]
    assert redis["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "1Gi"
    external = render({"redis": {"enabled": False, "externalUrl": "redis://state.example:6379/2"}})
    assert "StatefulSet" not in {o["kind"] for o in external}
    env = {
        e["name"]: e
        for e in by_kind(external, "Deployment")["lorafaas-controller"]["spec"]["template"]["spec"]["containers"][0][
            "env"
        ]
    }
    assert env["LORAFAAS_STATE_URL"]["value"] == "redis://state.example:6379/2"
    with pytest.raises(helm.HelmError, match=r"redis\.externalUrl is required"):
        render({"redis": {"enabled": False}})


def daemons(agent_pod_spec: dict) -> list[dict]:
    """The node agent's daemon containers (one per device and backbone; the holder is the other)."""
    return [c for c in agent_pod_spec["containers"] if c["name"].startswith("daemon-")]


def test_gpu_values_run_a_daemon_per_gpu_and_backbone_on_gpu_nodes_cpu_values_request_none() -> None:
    """The agent pod holds all gpu.perNode GPUs of its node (one container requests them) and runs a daemon per
    (GPU, backbone); function pods request no GPU (the controller pins each to its daemon's GPU); no host namespace."""
    values = values_of("gpu")
    values["gpu"]["perNode"] = 2
    values["nodeAgent"]["backbones"] = ["smollm2-135m", "tiny"]
    gpu = render(values)
    agent = by_kind(gpu, "DaemonSet")["lorafaas-node-agent"]["spec"]["template"]["spec"]
    assert agent["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert agent["tolerations"][0]["key"] == "nvidia.com/gpu"
    by_device = {(c["args"][4], c["args"][c["args"].index("--device") + 1]): c for c in daemons(agent)}
    assert set(by_device) == {(b, f"cuda:{i}") for b in ("smollm2-135m", "tiny") for i in (0, 1)}
    for (backbone, device), container in by_device.items():
        socket = f"/var/lib/lorafaas/run/{backbone}@{device.replace(':', '-')}.sock"
        assert container["readinessProbe"]["exec"]["command"] == ["test", "-S", socket]
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["NVIDIA_VISIBLE_DEVICES"] == "0,1" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert container["image"] == "lorafaas/node-agent:0.1.0-cuda"
    requests = [c["resources"]["limits"].get("nvidia.com/gpu") for c in agent["containers"] if c["name"] != "holder"]
    assert requests == ["2", None, None, None]  # the node's GPUs, held once by the pod
    controller = by_kind(gpu, "Deployment")["lorafaas-controller"]["spec"]["template"]["spec"]["containers"][0]
    assert controller["args"][controller["args"].index("--devices") + 1] == "cuda:0=20G,cuda:1=20G"
    worker = function_pod(gpu)["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in yaml.safe_dump(worker["resources"])
    assert not {"hostIPC", "hostPID"} & set(yaml.safe_dump(gpu).replace(":", " ").split())
    for values_name in ("default", "cpu"):
        objects = render(values_of(values_name))
        assert "nvidia.com/gpu" not in yaml.safe_dump(objects)
        assert "NVIDIA_VISIBLE_DEVICES" not in yaml.safe_dump(objects)


def test_a_runtime_class_for_the_nvidia_runtime_applies_to_agents_and_function_pods_on_gpus() -> None:
    values = {**values_of("gpu"), "gpu": {"perNode": 1, "runtimeClassName": "nvidia"}}
    objects = render(values)
    assert by_kind(objects, "DaemonSet")["lorafaas-node-agent"]["spec"]["template"]["spec"]["runtimeClassName"] == (
        "nvidia")
    assert function_pod(objects)["spec"]["runtimeClassName"] == "nvidia"
    assert "runtimeClassName" not in yaml.safe_dump(render({"gpu": {"runtimeClassName": "nvidia"}}))  # CPU: none


def test_node_agents_serve_each_backbone_and_function_pods_mount_nothing_of_the_home_by_themselves() -> None:
    objects = render({"nodeAgent": {"backbones": ["smollm2-135m", "tiny"]}})
    agent = by_kind(objects, "DaemonSet")["lorafaas-node-agent"]["spec"]["template"]
    assert agent["metadata"]["annotations"]["lorafaas.io/backbones"] == "smollm2-135m,tiny"
    containers = daemons(agent["spec"])
    assert [c["args"][4] for c in containers] == ["smollm2-135m", "tiny"]
    assert containers[1]["readinessProbe"]["exec"]["command"] == ["test", "-S", "/var/lib/lorafaas/run/tiny@cpu.sock"]
    # beside them the holder: their segments across a restart, and the liveness port the controller probes
    [holder] = [c for c in agent["spec"]["containers"] if c["name"] == "holder"]
    assert holder["args"] == ["--home", "/var/lib/lorafaas", "backbone", "hold", "smollm2-135m", "tiny",
                              "--device", "cpu", "--port", "9100"]
    assert holder["readinessProbe"]["tcpSocket"] == {"port": "agent"}
    controller = by_kind(objects, "Deployment")["lorafaas-controller"]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "LORAFAAS_AGENT_PORT", "value": "9100"} in controller["env"]
    policy = by_kind(objects, "NetworkPolicy")["lorafaas-node-agent"]["spec"]
    assert policy["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 9100}]
    volumes = {v["name"]: v for v in agent["spec"]["volumes"]}
    assert volumes["shm"] == {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "4Gi"}}  # not the host's
    assert volumes["home"]["hostPath"] == {"path": "/var/lib/lorafaas", "type": "DirectoryOrCreate"}
    pod = function_pod(objects)["spec"]
    # the backend mounts the daemon socket directory, the backbone entry and the instance's adapter, read-only
    assert {v["name"] for v in pod["volumes"]} == {"home", "tmp"}
    assert pod["containers"][0]["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    claim = render({"home": {"existingClaim": "lorafaas-home"}})
    assert {v["name"]: v for v in function_pod(claim)["spec"]["volumes"]}["home"] == {
        "name": "home",
        "persistentVolumeClaim": {"claimName": "lorafaas-home"},
    }


def test_the_daemons_float32_kernel_is_measured_unless_set_and_a_bad_setting_is_refused() -> None:
    def kernels(values: dict | None) -> list[str]:
        agent = by_kind(render(values), "DaemonSet")["lorafaas-node-agent"]["spec"]["template"]["spec"]
        return [{e["name"]: e["value"] for e in c["env"]}["LORAFAAS_CPU_LINEAR"] for c in daemons(agent)]

    assert kernels(None) == ["auto"]
    assert kernels({"nodeAgent": {"cpuLinear": "torch", "backbones": ["smollm2-135m", "tiny"]}}) == ["torch", "torch"]
    with pytest.raises(helm.HelmError, match="cpuLinear"):
        render({"nodeAgent": {"cpuLinear": "mkl"}})


def test_a_home_shared_by_several_nodes_keeps_each_nodes_daemon_sockets_on_the_node() -> None:
    """home.runHostPath: agents and function pods mount the node's directory at <home>/run (the daemons' sockets and
    locks), so that each node's daemons start and its function pods reach them; prepare-home hands it to the user."""
    objects = render({"home": {"existingClaim": "lorafaas-home", "runHostPath": "/var/run/lorafaas"}})
    run = {"name": "run", "hostPath": {"path": "/var/run/lorafaas", "type": "DirectoryOrCreate"}}
    agent = by_kind(objects, "DaemonSet")["lorafaas-node-agent"]["spec"]["template"]["spec"]
    assert run in agent["volumes"]
    for container in [*agent["initContainers"], *agent["containers"]]:
        assert {"name": "run", "mountPath": "/var/lib/lorafaas/run"} in container["volumeMounts"], container["name"]
    [prepare] = [c for c in agent["initContainers"] if c["name"] == "prepare-home"]
    assert prepare["args"] == ["chown 10001:10001 /var/lib/lorafaas/run\n"]  # not the claim: it is the operator's
    pod = function_pod(objects)["spec"]
    assert run in pod["volumes"]
    worker_mounts = pod["containers"][0]["volumeMounts"]
    assert {"name": "run", "mountPath": "/var/lib/lorafaas/run", "readOnly": True} in worker_mounts
    # without it, nothing changes: no hostPath in function pods, no prepare-home with a claim
    claim = render({"home": {"existingClaim": "lorafaas-home"}})
    assert "hostPath" not in yaml.safe_dump(function_pod(claim))
    assert "prepare-home" not in yaml.safe_dump(by_kind(claim, "DaemonSet"))


def test_rbac_allows_only_pods_and_the_template_and_function_pods_only_accept_the_controller() -> None:
    objects = render()
    rules = by_kind(objects, "Role")["lorafaas-controller"]["rules"]
    assert {r for rule in rules for r in rule["resources"]} == {"pods", "pods/log", "configmaps"}
    configmaps = next(rule for rule in rules if rule["resources"] == ["configmaps"])
    assert configmaps["verbs"] == ["get"] and configmaps["resourceNames"] == ["lorafaas-function-pod"]
    assert "update" not in {v for rule in rules for v in rule["verbs"]}
    policy = by_kind(objects, "NetworkPolicy")["lorafaas-function"]["spec"]
    assert policy["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "function"
    [rule] = policy["ingress"]
    assert rule["from"] == [
        {
            "podSelector": {
                "matchLabels": {
                    "app.kubernetes.io/name": "lorafaas",
                    "app.kubernetes.io/instance": "lorafaas",
                    "app.kubernetes.io/component": "controller",
                }
            }
        }
    ]
    assert rule["ports"] == [{"protocol": "TCP", "port": 9000}]


def test_optional_ingress_and_an_existing_admin_key_secret() -> None:
    objects = render(
        {
            "controller": {"ingress": {"enabled": True, "className": "nginx", "host": "lf.example"}},
            "adminKey": {"existingSecret": "my-key", "secretKey": "token"},
        }
    )
    ingress = by_kind(objects, "Ingress")["lorafaas-controller"]
    kubernetes_validate.validate(ingress, KUBERNETES_VERSION, strict=True)
    assert ingress["spec"]["rules"][0]["host"] == "lf.example"
    assert "Secret" not in {o["kind"] for o in objects}
    assert admin_key_source(by_kind(objects, "Deployment")["lorafaas-controller"]) == ("my-key", "token")


def test_a_gateway_closed_to_all_but_some_sources_still_lets_function_pods_fetch_their_adapter() -> None:
    ingress = {"namespaceSelector": {"matchLabels": {"team": "edge"}}}
    policy = by_kind(render({"networkPolicy": {"gatewayFrom": [ingress]}}), "NetworkPolicy")["lorafaas-controller"]
    [rule] = policy["spec"]["ingress"]
    assert rule["from"][0] == ingress
    assert rule["from"][1]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "function"
    assert "from" not in by_kind(render(), "NetworkPolicy")["lorafaas-controller"]["spec"]["ingress"][0]
