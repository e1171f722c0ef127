"""The Kubernetes backend's settings (`KubernetesConfig`) and how its collaborators call the API server."""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from lorafaas.errors import InstanceUnavailable, InvalidInput
from lorafaas.platform.backends.function_pod import check_release
from lorafaas.platform.backends.pod_status import LABEL_COMPONENT, LABEL_INSTANCE

NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True)
class KubernetesConfig:
    namespace: str
    release: str  # the Helm release: every object of ours carries app.kubernetes.io/instance=<release>
    pod_template: str  # the ConfigMap holding the function pod template under `pod.yaml`
    home: Path = Path("/var/lib/lorafaas")  # LORAFAAS_HOME, the same path in the controller, agents and functions
    device: str = "cpu"  # the first device: what a launch without one runs on
    devices: tuple[str, ...] = ()  # every device each agent node serves (cuda:0, cuda:1, ...); empty: (device,)
    worker_port: int = 9000
    delete_timeout_s: float = 30.0
    adopt_window_s: float = 120.0  # after a restart: how long the previous controller's pods wait to be claimed
    listen_on_pod_ip: bool = False  # workers bind their pod IP, not 0.0.0.0 (pods sharing one network: tests)
    # The controller's URL as function pods reach it (its Service): each pod fetches its adapter from it into its own
    # volume. None: pods mount their adapter from the home (a home every node shares, or one node).
    adapter_url: str | None = None
    agent_port: int | None = None  # the node agents' liveness port (their holder's); None: not probed
    watch_timeout_s: int = 240  # the server ends each pod watch after this; the client gives up 5 s later

    def __post_init__(self) -> None:
        if not 0 < self.worker_port < 65536:
            raise InvalidInput(f"worker port is {self.worker_port}; it must lie between 1 and 65535")
        if not (NAMESPACE.match(self.namespace) and len(self.namespace) <= 63):
            raise InvalidInput(f"namespace {self.namespace!r} is not a DNS label")
        check_release(self.release)
        if self.agent_port is not None and not 0 < self.agent_port < 65536:
            raise InvalidInput(f"agent port is {self.agent_port}; it must lie between 1 and 65535")
        if self.devices and self.devices[0] != self.device:
            raise InvalidInput(f"devices {', '.join(self.devices)} must start with device {self.device}")
        if not 0 <= self.adopt_window_s <= 3600:
            raise InvalidInput(f"adopt window is {self.adopt_window_s} s; it must lie between 0 and 3600 s")
        if not 1 <= self.watch_timeout_s <= 3600:
            raise InvalidInput(f"watch timeout is {self.watch_timeout_s} s; it must lie between 1 and 3600 s")

    @classmethod
    def from_env(cls, home: Path, devices: tuple[str, ...] = ("cpu",)) -> KubernetesConfig:
        """In the controller pod: the chart sets these (the namespace from the downward API)."""
        missing = [k for k in ("POD_NAMESPACE", "LORAFAAS_RELEASE", "LORAFAAS_POD_TEMPLATE") if not os.environ.get(k)]
        if missing:
            raise InvalidInput(
                f"the Kubernetes backend needs {', '.join(missing)} in the environment (set by the chart)"
            )
        return cls(
            namespace=os.environ["POD_NAMESPACE"],
            release=os.environ["LORAFAAS_RELEASE"],
            pod_template=os.environ["LORAFAAS_POD_TEMPLATE"],
            home=Path(home),
            device=devices[0],
            devices=tuple(devices),
            worker_port=int(os.environ.get("LORAFAAS_WORKER_PORT", "9000")),
            listen_on_pod_ip=os.environ.get("LORAFAAS_WORKER_LISTEN", "any") == "pod-ip",
            adapter_url=os.environ.get("LORAFAAS_ADAPTER_URL") or None,
            agent_port=int(os.environ["LORAFAAS_AGENT_PORT"]) if os.environ.get("LORAFAAS_AGENT_PORT") else None,
        )

    @property
    def served_devices(self) -> tuple[str, ...]:
        return self.devices or (self.device,)

    @property
    def watch_selector(self) -> str:
        """The pods the backend follows: its function pods and the node agents."""
        return f"{LABEL_INSTANCE}={self.release},{LABEL_COMPONENT} in (function,node-agent)"


def api_call(what: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`method(*args, **kwargs)`, its ApiException as InstanceUnavailable saying `what` failed."""
    try:
        return method(*args, **kwargs)
    except ApiException as exc:
        raise InstanceUnavailable(f"{what} failed: {exc.status} {exc.reason}: {api_message(exc)}") from exc


def api_message(exc: ApiException) -> str:
    if exc.body is None:
        return ""
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        return json.loads(exc.body).get("message", "")
    return str(exc.body)


def load_client_config() -> k8s.ApiClient:
    """In a pod: its service account; elsewhere: KUBECONFIG or ~/.kube/config."""
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return k8s.ApiClient()
