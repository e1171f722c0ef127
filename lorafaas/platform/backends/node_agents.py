"""The backbone daemons on Kubernetes: the node-agent DaemonSet runs them, and its ready pods (as the watch sees them,
no API call) say which node serves which backbone.

A pod's Ready condition is the kubelet's word: when a machine goes, its kubelet with it, the condition stays True
until the node lifecycle controller notices (40 s by default) and the pods placed there meanwhile wait for nothing.
So the controller also asks the agents themselves (`AgentLiveness`): each ready agent's holder answers on its port
(lorafaas/backbone_daemon/segment_holder.py); an agent that has not answered for `LOST_AFTER_S` is lost, its node
leaves placement at once and a launch bound to it is abandoned (kubernetes.py).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kubernetes import client as k8s

from lorafaas.errors import DaemonUnavailable, InvalidInput
from lorafaas.platform.backends.kubernetes_config import KubernetesConfig
from lorafaas.platform.backends.pod_status import ANNOTATION_BACKBONES, LABEL_COMPONENT, is_ready, pod_meta, pod_spec
from lorafaas.protocols.daemon_config import DaemonPaths

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 1.0
LOST_AFTER_S = 3.0  # an agent whose every probe failed for this long is lost


class NodeAgents:
    """`pods()`: the pods the watch follows now (started on first use)."""

    def __init__(self, config: KubernetesConfig, pods: Callable[[], list[k8s.V1Pod]]) -> None:
        self.config = config
        self._pods = pods
        self.liveness = AgentLiveness(config.agent_port, self.ready_agents) if config.agent_port else None

    def start(self) -> None:
        if self.liveness is not None:
            self.liveness.start()

    def stop(self) -> None:
        if self.liveness is not None:
            self.liveness.stop()

    def lost(self, node: str | None) -> bool:
        """Whether the agent on `node` stopped answering (its pod may still look ready)."""
        return self.liveness is not None and node is not None and node in self.liveness.lost_nodes()

    def ready_agents(self) -> list[k8s.V1Pod]:
        """The node-agent pods the kubelets report ready (from the watch: no API call)."""
        return [pod for pod in self._pods()
                if (pod_meta(pod).labels or {}).get(LABEL_COMPONENT) == "node-agent" and pod_spec(pod).node_name
                and pod_meta(pod).deletion_timestamp is None and is_ready(pod)]

    def agent_nodes(self) -> dict[str, set[str]]:
        """node name -> the backbones its ready (and answering) node-agent pod serves."""
        lost = self.liveness.lost_nodes() if self.liveness is not None else set()
        nodes: dict[str, set[str]] = {}
        for pod in self.ready_agents():
            node = pod_spec(pod).node_name
            if node and node not in lost:
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


class AgentLiveness:
    """Probes the ready agents' `port` every PROBE_INTERVAL_S from a thread of its own; `lost_nodes()` reads the
    verdicts (no I/O)."""

    def __init__(self, port: int, agents: Callable[[], list[k8s.V1Pod]]) -> None:
        self.port = port
        self._agents = agents
        self._failing_since: dict[str, tuple[str, float]] = {}  # pod uid -> (node, first failed probe in a row)
        self._num_probed = 0
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._probe_forever, name="agent-liveness", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def lost_nodes(self) -> set[str]:
        """The nodes whose agent has not answered for LOST_AFTER_S; none while no agent answers at all (the probe,
        not every machine, is what fails then: e.g. a port closed to the controller)."""
        now = time.monotonic()
        with self._lock:
            if len(self._failing_since) >= self._num_probed:
                return set()
            return {node for node, since in self._failing_since.values() if now - since >= LOST_AFTER_S}

    def _probe_forever(self) -> None:
        with ThreadPoolExecutor(max_workers=16, thread_name_prefix="agent-probe") as pool:
            while not self._stopped.is_set():
                agents = [(pod_meta(p).uid or "", pod_spec(p).node_name or "", p.status.pod_ip)
                          for p in self._agents() if p.status is not None and p.status.pod_ip]
                answers = list(pool.map(lambda agent: self._answers(agent[2]), agents))
                now = time.monotonic()
                with self._lock:
                    before, self._num_probed = dict(self._failing_since), len(agents)
                    self._failing_since = {uid: before.get(uid, (node, now))
                                           for (uid, node, _ip), answered in zip(agents, answers, strict=True)
                                           if not answered}
                for uid, (node, _since) in self._failing_since.items():
                    if uid not in before:
                        log.warning("the node agent on %s does not answer on port %d", node, self.port)
                self._stopped.wait(PROBE_INTERVAL_S)

    def _answers(self, ip: str) -> bool:
        try:
            with socket.create_connection((ip, self.port), timeout=PROBE_TIMEOUT_S) as conn:
                return conn.recv(8).startswith(b"ok")
        except OSError:
            return False
