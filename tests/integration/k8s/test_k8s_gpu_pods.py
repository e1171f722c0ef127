"""A GPU node with 2 GPUs, checked by the real API server (server-side dry runs: nothing is created): the chart's
node agent holds both GPUs and runs a daemon per (GPU, backbone), and each function pod the controller builds carries
the GPU of the daemon it binds (NVIDIA_VISIBLE_DEVICES), requests no nvidia.com/gpu, and nothing uses a host
namespace."""

from __future__ import annotations

from pathlib import PurePosixPath

import yaml
from k8s_env import BACKBONE, CHART, NODES, TEMPLATE, Release, create_object, render_chart

GPUS_PER_NODE = 2


def gpu_values() -> dict:
    values = yaml.safe_load((CHART / "values-gpu.yaml").read_text())
    values["gpu"]["perNode"] = GPUS_PER_NODE
    values["nodeAgent"]["backbones"] = [BACKBONE, "tiny"]
    return values


def daemons_by_socket(daemon_set: dict) -> dict[str, str]:
    """socket file name -> the device its daemon serves, from the DaemonSet as the server returned it (the test's
    home is not the chart's mount path: the names are what both share)."""
    containers = daemon_set["spec"]["template"]["spec"]["containers"]
    return {PurePosixPath(c["readinessProbe"]["exec"]["command"][-1]).name: c["args"][c["args"].index("--device") + 1]
            for c in containers if c["name"].startswith("daemon-")}  # the holder is the agent's other container


def test_each_function_pod_carries_its_daemons_gpu_and_nothing_uses_a_host_namespace(release: Release) -> None:
    objects = render_chart(release.namespace, gpu_values(), name="check")
    api = release.plane.api_client()
    accepted = [api.sanitize_for_serialization(returned) for obj in objects  # as the server would store them
                for returned in create_object(api, obj, namespace=release.namespace, dry_run="All")]
    [daemon_set] = [o for o in accepted if o["kind"] == "DaemonSet"]
    agent = daemon_set["spec"]["template"]["spec"]
    assert sum(int(c["resources"].get("limits", {}).get("nvidia.com/gpu", 0)) for c in agent["containers"]) == 2
    daemons = daemons_by_socket(daemon_set)
    assert sorted(daemons.values()) == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]  # per GPU and backbone

    template = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("function-pod"))
    release.admin.patch_namespaced_config_map(TEMPLATE, release.namespace,
                                              {"data": {"pod.yaml": template["data"]["pod.yaml"]}})
    release.add_agent(NODES[0], backbones=f"{BACKBONE},tiny")
    backend = release.backend(device="cuda:0", devices=("cuda:0", "cuda:1"))
    backend.start()  # the controller's own dry run of the GPU template
    pods = []
    for device in ("cuda:0", "cuda:1"):
        spec = backend.spec("pirate", BACKBONE, None, device=device)
        pod = backend.pod_template.build_pod(spec, BACKBONE, backend.agents.backbone_nodes(BACKBONE))
        created = release.admin.create_namespaced_pod(release.namespace, backend.pod_template.to_dict(pod),
                                                      dry_run="All")
        pods.append(release.plane.api_client().sanitize_for_serialization(created))
        [worker] = pods[-1]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in worker["env"]}
        assert daemons[PurePosixPath(spec.daemon_socket).name] == device == f"cuda:{env['NVIDIA_VISIBLE_DEVICES']}"
        assert "nvidia.com/gpu" not in str(worker["resources"])
    assert {p["spec"]["containers"][0]["env"][-1]["value"] for p in pods} == {"0", "1"}
    for obj in [*accepted, *pods]:
        assert not {"hostIPC", "hostPID"} & set(yaml.safe_dump(obj).replace(":", " ").split()), obj["kind"]
    assert release.function_pods() == []  # checked, not created
