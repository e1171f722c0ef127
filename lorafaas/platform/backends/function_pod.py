"""The pod of one function instance, built from the chart's template: pure, no API calls.

    labels       app.kubernetes.io/{name,instance,component=function,managed-by}, lorafaas.io/{function,backbone}
    annotations  lorafaas.io/instance-id, lorafaas.io/worker-spec (the WorkerSpec as JSON: enough to adopt the pod)
    owner        the template ConfigMap, as the pod's controller: `helm uninstall` garbage-collects every function pod,
                 and `kubectl drain` evicts function pods like any managed pod (the node agent starts replacements)
    affinity     required: one of the nodes whose node-agent pod is ready and serves the backbone, one
                 nodeSelectorTerm per node (the API server allows a single value per `matchFields` requirement)
    worker       `python -m lorafaas.function_runtime.worker <spec>` listening on tcp://0.0.0.0:PORT
    GPU          an instance on cuda:N (its daemon's GPU on every agent node) gets NVIDIA_VISIBLE_DEVICES=N and no
                 nvidia.com/gpu: the NVIDIA runtime gives the pod that one GPU, which its worker sees as cuda:0
                 (docs/kubernetes.md, "GPUs": a device-plugin request could not give it its daemon's GPU)
    mounts       of the template's `home` volume, read-only and nothing else: the daemon socket directory, the
                 backbone's store entry (config, tokenizer) and the instance's own adapter (subPath mounts)
    adapter      with an `AdapterSource` (the chart's default): the adapter is not mounted from the home but fetched
                 by an init container (`adapter-fetch`) from the controller into the pod's own emptyDir, digest
                 checked, and mounted read-only where the worker reads it: no volume shared between nodes is needed
"""

from __future__ import annotations

import copy
import hashlib
import re
from dataclasses import dataclass
from pathlib import PurePosixPath

import msgspec
from kubernetes import client as k8s

from lorafaas.errors import InvalidInput
from lorafaas.function_runtime.messages import WorkerSpec
from lorafaas.platform.backends.pod_status import (
    ANNOTATION_INSTANCE_ID,
    ANNOTATION_SPEC,
    LABEL_BACKBONE,
    LABEL_COMPONENT,
    LABEL_FUNCTION,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
)

WORKER_CONTAINER = "worker"
FETCH_CONTAINER = "adapter-fetch"
ADAPTER_VOLUME = "adapter"
FETCH_DIR = "/adapter"
FETCH_RESOURCES = ("cpu", "memory", "ephemeral-storage")  # the worker's, less devices (a GPU is not for the fetch)
MAX_NAME = 63  # a pod name is a DNS subdomain (253), but its hostname, taken from the name, is one DNS label
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
VISIBLE_GPUS = "NVIDIA_VISIBLE_DEVICES"  # read by the NVIDIA container runtime: the GPUs it gives the container
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def pod_name(release: str, instance_id: str) -> str:
    """`<release>-fn-<instance id>`, lowercase, at most 63 characters (a long name keeps a hash of the whole)."""
    return dns_label(f"{release}-fn-{instance_id}")


def dns_label(text: str) -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    if len(name) <= MAX_NAME and name == text:
        return name
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    return f"{name[: MAX_NAME - 9].rstrip('-')}-{digest}"


def label_value(text: str) -> str:
    """A valid label value for `text`: itself when it is one; else cut to 54 characters plus a hash of the whole."""
    if LABEL_VALUE.match(text) and len(text) <= MAX_NAME:
        return text
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-_.")
    return f"{cleaned[:54].rstrip('-_.')}-{hashlib.sha256(text.encode()).hexdigest()[:8]}".lstrip("-")


def check_release(release: str) -> str:
    """The release is a label value on everything and the start of every pod name."""
    if not (release and DNS_LABEL.match(release) and len(release) <= 53):
        raise InvalidInput(f"release name {release!r} is invalid: use 1-53 lowercase letters, digits and '-' "
                           "(what Helm allows), starting and ending with a letter or digit")
    return release


@dataclass(frozen=True)
class AdapterSource:
    """Where a pod fetches its adapter: the controller's URL, and the token for this function's adapter only."""

    url: str
    token: str


def build_function_pod(
    template: k8s.V1Pod,
    owner: k8s.V1OwnerReference,
    spec: WorkerSpec,
    *,
    namespace: str,
    release: str,
    backbone: str,
    nodes: list[str],
    worker_port: int,
    home: str = "/var/lib/lorafaas",
    listen_on_pod_ip: bool = False,
    adapter_source: AdapterSource | None = None,
) -> k8s.V1Pod:
    """The pod for one instance: the template with our identity, command, port, probe and placement."""
    if not nodes:
        raise InvalidInput(f"no node to place {spec.function} on")
    pod: k8s.V1Pod = copy.deepcopy(template)
    if pod.spec is None:
        raise InvalidInput("the function pod template has no spec")
    meta = pod.metadata or k8s.V1ObjectMeta()
    meta.name = pod_name(release, spec.instance_id)
    meta.namespace = namespace
    meta.labels = {
        **(meta.labels or {}),
        LABEL_NAME: "lorafaas",
        LABEL_INSTANCE: release,
        LABEL_COMPONENT: "function",
        LABEL_MANAGED_BY: "lorafaas-controller",
        LABEL_FUNCTION: label_value(spec.function),
        LABEL_BACKBONE: label_value(backbone),
    }
    meta.annotations = {
        **(meta.annotations or {}),
        ANNOTATION_INSTANCE_ID: spec.instance_id,
        ANNOTATION_SPEC: msgspec.json.encode(spec).decode(),
    }
    meta.owner_references = [owner]
    pod.metadata = meta
    pod.spec.restart_policy = "Never"  # the node agent restarts crashed instances itself
    worker = next((c for c in pod.spec.containers if c.name == WORKER_CONTAINER), None)
    if worker is None:
        raise InvalidInput(f"the function pod template has no container named {WORKER_CONTAINER!r}")
    worker.command = ["python", "-m", "lorafaas.function_runtime.worker"]
    in_pod = spec
    gpu = gpu_index(spec.device)
    if gpu is not None:  # pinned to its daemon's GPU, the only one the pod sees
        in_pod = msgspec.structs.replace(in_pod, device="cuda:0")
        worker.env = [*(e for e in worker.env or [] if e.name != VISIBLE_GPUS),
                      k8s.V1EnvVar(name=VISIBLE_GPUS, value=str(gpu))]
    if listen_on_pod_ip:  # the kubelet expands $(POD_IP) in args from the downward API
        in_pod = msgspec.structs.replace(in_pod, socket_path=f"tcp://$(POD_IP):{worker_port}")
        pod_ip = k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(field_path="status.podIP"))
        worker.env = [*(e for e in worker.env or [] if e.name != "POD_IP"), k8s.V1EnvVar(name="POD_IP",
                                                                                         value_from=pod_ip)]
    worker.args = [msgspec.json.encode(in_pod).decode()]
    worker.ports = [k8s.V1ContainerPort(name="worker", container_port=worker_port, protocol="TCP")]
    worker.readiness_probe = k8s.V1Probe(
        tcp_socket=k8s.V1TCPSocketAction(port="worker"), period_seconds=1, failure_threshold=3
    )
    if adapter_source is not None and spec.adapter_dir is not None:
        add_adapter_fetch(pod.spec, worker, spec.function, spec.adapter_dir, adapter_source)
    if any(v.name == "home" for v in pod.spec.volumes or []):
        mounted = {m.mount_path for m in worker.volume_mounts or []}
        worker.volume_mounts = [*(worker.volume_mounts or []), *(
            m for m in home_mounts(spec, home, adapter=adapter_source is None) if m.mount_path not in mounted)]
    affinity = pod.spec.affinity or k8s.V1Affinity()
    affinity.node_affinity = k8s.V1NodeAffinity(
        required_during_scheduling_ignored_during_execution=k8s.V1NodeSelector(
            node_selector_terms=[  # terms are ORed; one value per matchFields requirement is all the server takes
                k8s.V1NodeSelectorTerm(
                    match_fields=[k8s.V1NodeSelectorRequirement(key="metadata.name", operator="In", values=[node])]
                )
                for node in sorted(set(nodes))
            ]
        )
    )
    pod.spec.affinity = affinity
    return pod


def add_adapter_fetch(pod_spec: k8s.V1PodSpec, worker: k8s.V1Container, function: str, adapter_dir: str,
                      source: AdapterSource) -> None:
    """An init container fetching the adapter into the pod's own volume, mounted read-only at `adapter_dir` in the
    worker; a failed fetch (refused, unreachable, digest mismatch) fails the pod with the fetch's last log lines."""
    digest = PurePosixPath(adapter_dir).name
    pod_spec.volumes = [*(v for v in pod_spec.volumes or [] if v.name != ADAPTER_VOLUME),
                        k8s.V1Volume(name=ADAPTER_VOLUME, empty_dir=k8s.V1EmptyDirVolumeSource())]
    resources = copy.deepcopy(worker.resources) or k8s.V1ResourceRequirements()
    resources.limits = {k: v for k, v in (resources.limits or {}).items() if k in FETCH_RESOURCES} or None
    resources.requests = {k: v for k, v in (resources.requests or {}).items() if k in FETCH_RESOURCES} or None
    env = {"LORAFAAS_ADAPTER_URL": source.url, "LORAFAAS_FUNCTION": function, "LORAFAAS_ADAPTER_DIGEST": digest,
           "LORAFAAS_ADAPTER_TOKEN": source.token, "HOME": "/tmp"}
    fetch = k8s.V1Container(
        name=FETCH_CONTAINER, image=worker.image, image_pull_policy=worker.image_pull_policy,
        command=["python", "-m", "lorafaas.function_runtime.adapter_fetch"], args=[FETCH_DIR],
        env=[k8s.V1EnvVar(name=k, value=v) for k, v in env.items()],
        security_context=copy.deepcopy(worker.security_context), resources=resources,
        volume_mounts=[k8s.V1VolumeMount(name=ADAPTER_VOLUME, mount_path=FETCH_DIR)],
        termination_message_policy="FallbackToLogsOnError",
    )
    pod_spec.init_containers = [*(c for c in pod_spec.init_containers or [] if c.name != FETCH_CONTAINER), fetch]
    worker.volume_mounts = [*(m for m in worker.volume_mounts or [] if m.mount_path != adapter_dir),
                            k8s.V1VolumeMount(name=ADAPTER_VOLUME, mount_path=adapter_dir, read_only=True)]


def gpu_index(device: str) -> int | None:
    """N for cuda:N (the GPU, as every daemon of an agent node numbers them); None for the CPU."""
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return None
    if not index.isdigit():
        raise InvalidInput(f"device {device!r} is not 'cpu' or 'cuda:N'")
    return int(index)


def home_mounts(spec: WorkerSpec, home: str, adapter: bool = True) -> list[k8s.V1VolumeMount]:
    """What a worker reads from the home, each mounted read-only at its own path: nothing else of the home (other
    functions' adapters, the state) is visible in its pod. `adapter`: its adapter too (unless fetched)."""
    root = PurePosixPath(home)
    paths = [PurePosixPath(spec.daemon_socket).parent if spec.daemon_socket else None, PurePosixPath(spec.model_dir),
             PurePosixPath(spec.adapter_dir) if spec.adapter_dir and adapter else None]
    mounts: dict[str, k8s.V1VolumeMount] = {}
    for path in paths:
        if path is not None and path != root and path.is_relative_to(root):
            mounts[str(path)] = k8s.V1VolumeMount(name="home", mount_path=str(path),
                                                  sub_path=str(path.relative_to(root)), read_only=True)
    return list(mounts.values())


def template_owner(config_map: k8s.V1ConfigMap) -> k8s.V1OwnerReference:
    meta = config_map.metadata
    if meta is None or meta.name is None or meta.uid is None:  # set on every ConfigMap the API server returns
        raise InvalidInput("the function pod template's ConfigMap has no name or uid")
    return k8s.V1OwnerReference(
        api_version="v1",
        kind="ConfigMap",
        name=meta.name,
        uid=meta.uid,
        controller=True,
        block_owner_deletion=False,
    )
