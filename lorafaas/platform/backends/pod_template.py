"""The function pod template: read once from the chart's ConfigMap, checked with the API server at start, and made
into each instance's pod (`function_pod.build_function_pod`)."""

from __future__ import annotations

import json
from pathlib import PurePosixPath
from typing import Any

import yaml
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from lorafaas.errors import InstanceUnavailable, InvalidInput
from lorafaas.function_runtime.messages import WorkerSpec
from lorafaas.platform.adapter_access import AdapterAccess
from lorafaas.platform.backends.function_pod import AdapterSource, build_function_pod, template_owner
from lorafaas.platform.backends.kubernetes_config import KubernetesConfig, api_call, api_message

TEMPLATE_KEY = "pod.yaml"


class PodTemplate:
    def __init__(self, config: KubernetesConfig, core: k8s.CoreV1Api, adapter_access: AdapterAccess) -> None:
        self.config = config
        self.core = core
        self.adapter_access = adapter_access
        self._serializer = k8s.ApiClient()  # only (de)serializes model objects; never sends a request
        self._template: k8s.V1Pod | None = None
        self._owner: k8s.V1OwnerReference | None = None

    def template(self) -> k8s.V1Pod:
        """The function pod template from its ConfigMap, read once."""
        if self._template is None:
            config_map = self._read_config_map()
            text = (config_map.data or {}).get(TEMPLATE_KEY)
            if not text:
                raise InvalidInput(f"ConfigMap {self.config.pod_template} has no {TEMPLATE_KEY}")
            self._template = self.pod_from_dict(yaml.safe_load(text))
        return self._template

    def owner(self) -> k8s.V1OwnerReference:
        if self._owner is None:
            self._owner = template_owner(self._read_config_map())
        return self._owner

    def build_pod(self, spec: WorkerSpec, backbone: str, nodes: list[str]) -> k8s.V1Pod:
        return build_function_pod(self.template(), self.owner(), spec, namespace=self.config.namespace,
                                  release=self.config.release, backbone=backbone, nodes=nodes,
                                  worker_port=self.config.worker_port, home=str(self.config.home),
                                  listen_on_pod_ip=self.config.listen_on_pod_ip,
                                  adapter_source=self.adapter_source(spec))

    def adapter_source(self, spec: WorkerSpec) -> AdapterSource | None:
        """Where the pod fetches its adapter (the controller, `config.adapter_url`), with its own token."""
        if self.config.adapter_url is None or spec.adapter_dir is None:
            return None
        digest = PurePosixPath(spec.adapter_dir).name
        return AdapterSource(self.config.adapter_url, self.adapter_access.token(spec.function, digest))

    def check(self) -> None:
        """Ask the API server whether a pod from the template is valid (a dry run: nothing is created), so that a
        template it refuses (e.g. a memory request above its limit) stops the controller at start with the server's
        reason instead of failing every launch."""
        probe = WorkerSpec(function="template-check", instance_id="template-check-0",
                           socket_path=f"tcp://0.0.0.0:{self.config.worker_port}",
                           model_dir=str(self.config.home / "models" / "template-check"),
                           adapter_dir=str(self.config.home / "adapters" / ("0" * 64)))
        pod = self.build_pod(probe, "template-check", ["template-check"])
        try:
            self.core.create_namespaced_pod(self.config.namespace, pod, dry_run="All")
        except ApiException as exc:
            if exc.status in (400, 422):
                raise InvalidInput(
                    f"the function pod template (ConfigMap {self.config.pod_template}, from the chart's function.* "
                    f"values) is refused by the API server: {api_message(exc)}"
                ) from exc
            raise InstanceUnavailable(f"checking the function pod template failed: {exc.status} {exc.reason}: "
                                      f"{api_message(exc)}") from exc

    def pod_from_dict(self, data: dict) -> k8s.V1Pod:
        """The template as a model object. Its quantities may be numbers (`cpu: 2` in a template edited by hand, or
        rendered by an older chart): the API server takes them, the client's models only strings, so they become
        strings here rather than stopping the controller."""
        try:
            return self._serializer.deserialize(json.dumps(quantities_as_strings(data)), "V1Pod", None)
        except ValueError as exc:  # pydantic's ValidationError: a field of the wrong type
            raise InvalidInput(f"the function pod template (ConfigMap {self.config.pod_template}) is not a valid "
                               f"pod: {exc}") from exc

    def to_dict(self, obj: Any) -> dict:
        """A model object as the API server receives it (camelCase, no nulls)."""
        return self._serializer.sanitize_for_serialization(obj)

    def _read_config_map(self) -> k8s.V1ConfigMap:
        return api_call(
            f"reading ConfigMap {self.config.pod_template}",
            self.core.read_namespaced_config_map,
            self.config.pod_template,
            self.config.namespace,
        )


def quantities_as_strings(pod: Any) -> Any:
    """`pod` (a pod as a dict) with every number among its containers' resources, its overhead and its emptyDir size
    limits written as the quantity string Kubernetes would print (2 -> "2", 0.5 -> "0.5")."""
    if not isinstance(pod, dict) or not isinstance(pod.get("spec"), dict):
        return pod
    spec = pod["spec"]
    maps = [spec.get("overhead")]
    for container in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        resources = container.get("resources") if isinstance(container, dict) else None
        if isinstance(resources, dict):
            maps += [resources.get("requests"), resources.get("limits")]
    for quantities in maps:
        if isinstance(quantities, dict):
            quantities.update({name: quantity_string(value) for name, value in quantities.items()})
    for volume in spec.get("volumes") or []:
        empty_dir = volume.get("emptyDir") if isinstance(volume, dict) else None
        if isinstance(empty_dir, dict) and "sizeLimit" in empty_dir:
            empty_dir["sizeLimit"] = quantity_string(empty_dir["sizeLimit"])
    return pod


def quantity_string(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return value  # a string already, or something the server will refuse with its own reason
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)
