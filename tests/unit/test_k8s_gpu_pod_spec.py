"""A function pod on a GPU node, built from the template the chart renders with values-gpu.yaml: pinned to its
daemon's GPU by NVIDIA_VISIBLE_DEVICES, requesting no nvidia.com/gpu, its worker computing on the one GPU it sees.
Pure (no API server); the server's dry run of the same pods is tests/integration/k8s/test_k8s_gpu_pods.py."""

import json
from pathlib import Path

import kubernetes_validate
import msgspec
import pytest
import yaml

helm = pytest.importorskip("helm_python")
k8s = pytest.importorskip("kubernetes.client")

from lorafaas.errors import InvalidInput  # noqa: E402
from lorafaas.function_runtime.messages import WorkerSpec  # noqa: E402
from lorafaas.platform.backends.function_pod import build_function_pod, template_owner  # noqa: E402
from lorafaas.platform.backends.kubernetes import KubernetesConfig  # noqa: E402
from lorafaas.platform.backends.pod_status import ANNOTATION_SPEC  # noqa: E402

CHART = Path(__file__).resolve().parents[2] / "manifests" / "charts" / "lorafaas"
SERIALIZER = k8s.ApiClient()


def gpu_template() -> tuple[k8s.V1Pod, k8s.V1OwnerReference]:
    values = yaml.safe_load((CHART / "values-gpu.yaml").read_text())
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values=values, name="lorafaas", namespace="lf", is_install=True)
    data = yaml.safe_load(rendered["lorafaas/templates/function-pod-template.yaml"])
    data["metadata"]["uid"] = "3f1c2a4e-0000-4000-8000-000000000002"
    config_map = SERIALIZER.deserialize(json.dumps(data), "V1ConfigMap", None)
    pod = SERIALIZER.deserialize(json.dumps(yaml.safe_load(config_map.data["pod.yaml"])), "V1Pod", None)
    return pod, template_owner(config_map)


def spec_on(device: str) -> WorkerSpec:
    return WorkerSpec(function="pirate", instance_id=f"pirate-{device[-1]}", socket_path="tcp://0.0.0.0:9000",
                      model_dir="/var/lib/lorafaas/models/smollm2-135m", device=device,
                      daemon_socket=f"/var/lib/lorafaas/run/smollm2-135m@{device.replace(':', '-')}.sock")


def build(spec: WorkerSpec, listen_on_pod_ip: bool = False) -> dict:
    template, owner = gpu_template()
    pod = build_function_pod(template, owner, spec, namespace="lf", release="lorafaas", backbone="smollm2-135m",
                             nodes=["gpu-node"], worker_port=9000, listen_on_pod_ip=listen_on_pod_ip)
    return SERIALIZER.sanitize_for_serialization(pod)


@pytest.mark.parametrize("listen_on_pod_ip", [False, True])
def test_each_function_pod_is_pinned_to_its_daemons_gpu(listen_on_pod_ip: bool) -> None:
    for index in (0, 1):
        pod = build(spec_on(f"cuda:{index}"), listen_on_pod_ip)
        kubernetes_validate.validate(pod, "1.30", strict=True)
        [worker] = pod["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in worker["env"]}
        assert env["NVIDIA_VISIBLE_DEVICES"] == str(index)  # the GPU of the daemon it binds ...
        in_pod = msgspec.json.decode(worker["args"][0], type=WorkerSpec)
        assert in_pod.daemon_socket == f"/var/lib/lorafaas/run/smollm2-135m@cuda-{index}.sock"
        assert in_pod.device == "cuda:0"  # ... the only GPU the pod sees
        recorded = msgspec.json.decode(pod["metadata"]["annotations"][ANNOTATION_SPEC], type=WorkerSpec)
        assert recorded.device == f"cuda:{index}"  # adoption matches the controller's own spec
        assert "nvidia.com/gpu" not in json.dumps(worker["resources"])  # the plugin would pick some other GPU
        assert not {"hostIPC", "hostPID"} & set(pod["spec"])


def test_a_cpu_pod_is_not_pinned_and_a_malformed_gpu_is_refused() -> None:
    spec = msgspec.structs.replace(spec_on("cuda:0"), device="cpu", daemon_socket=None)
    assert "NVIDIA_VISIBLE_DEVICES" not in json.dumps(build(spec))
    with pytest.raises(InvalidInput, match="cuda:x"):
        build(msgspec.structs.replace(spec, device="cuda:x"))


def test_the_backend_config_serves_every_gpu_of_a_node_starting_with_its_device() -> None:
    config = KubernetesConfig(namespace="lf", release="lorafaas", pod_template="t", device="cuda:0",
                              devices=("cuda:0", "cuda:1"))
    assert config.served_devices == ("cuda:0", "cuda:1")
    with pytest.raises(InvalidInput, match="must start with device cuda:0"):
        KubernetesConfig(namespace="lf", release="lorafaas", pod_template="t", device="cuda:0",
                         devices=("cuda:1", "cuda:0"))
