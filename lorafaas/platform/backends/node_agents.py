"""The backbone daemons on Kubernetes: the node-agent DaemonSet runs them, and its ready pods (as the watch sees them,
no API call) say which node serves which backbone."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kubernetes import client as k8s

from lorafaas.errors import DaemonUnavailable, InvalidInput
from lorafaas.platform.backends.kubernetes_config import KubernetesConfig
from lorafaas.platform.backends.pod_status import ANNOTATION_BACKBONES, LABEL_COMPONENT, is_ready, pod_meta, pod_spec
from lorafaas.protocols.daemon_config import DaemonPaths


class NodeAgents:
    """`pods()`: the pods the watch follows now (started on first use)."""

    def __init__(self, config: KubernetesConfig, pods: Callable[[], list[k8s.V1Pod]]) -> None:
        self.config = config
        self._pods = pods

    def agent_nodes(self) -> dict[str, set[str]]:
        """node name -> the backbones its ready node-agent pod serves (from the watch: no API call)."""
        nodes: dict[str, set[str]] = {}
        for pod in self._pods():
            node = pod_spec(pod).node_name
            if ((pod_meta(pod).labels or {}).get(LABEL_COMPONENT) == "node-agent" and node
                    and pod_meta(pod).deletion_timestamp is None and is_ready(pod)):
                served = (pod_meta(pod).annotations or {}).get(ANNOTATION_BACKBONES, "")
                nodes.setdefault(node, set()).update(b for b in served.split(",") if b)
        return nodes

    def backbone_nodes(self, backbone: str) -> list[str]:
        return sorted(node for node, served in self.agent_nodes().items() if backbone in served)

    def backbones(self) -> list[str]:
        return sorted(set().union(*self.agent_nodes().values()))

    def daemon_socket(self, backbone: str, device: str | None = None) -> Path:
        """The socket of the daemon serving `backbone` on `device` (the same path on every agent node)."""
        if not self.backbone_nodes(backbone):
            raise DaemonUnavailable(
                f"no ready node agent serves backbone {backbone!r}; add it to the chart's "
                "nodeAgent.backbones and check the node-agent pods"
            )
        return DaemonPaths.of(self.config.home, backbone, device or self.config.device).socket

    def check_device(self, device: str | None) -> None:
        if device is not None and device not in self.config.served_devices:
            raise InvalidInput(f"device {device} is not this backend's; its pods run on "
                               f"{', '.join(self.config.served_devices)}")
