"""What a function pod's status says: its identity labels, whether it is ready, and why it failed (`PodFailure`).

Shared by the Kubernetes backend and its tests; pure reads of `kubernetes.client` model objects, no API calls.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kubernetes import client as k8s

from lorafaas.platform.descriptions import FailureView

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_FUNCTION = "lorafaas.io/function"
LABEL_BACKBONE = "lorafaas.io/backbone"
ANNOTATION_INSTANCE_ID = "lorafaas.io/instance-id"
ANNOTATION_SPEC = "lorafaas.io/worker-spec"
ANNOTATION_BACKBONES = "lorafaas.io/backbones"  # on node-agent pods: the backbones their daemons serve

# Waiting reasons after which a container will not start by itself.
FAILED_WAITING_REASONS = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "CrashLoopBackOff",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)


@dataclass(frozen=True)
class PodFailure:
    """Why a function pod did not run; `describe` lists these."""

    function: str
    instance_id: str
    pod: str
    reason: str  # e.g. ImagePullBackOff, OOMKilled, Evicted, Unschedulable, Error
    message: str
    exit_code: int | None = None
    at: float = field(default_factory=time.time)

    def describe(self) -> FailureView:
        return FailureView(instance_id=self.instance_id, pod=self.pod, reason=self.reason, message=self.message,
                           exit_code=self.exit_code, at=self.at)


def pod_meta(pod: k8s.V1Pod) -> k8s.V1ObjectMeta:
    """A pod's metadata. The API server (so the watch) always sends it; the client's models type every field as
    optional, so this is where its absence is an error."""
    if pod.metadata is None:
        raise ValueError("a pod without metadata")
    return pod.metadata


def pod_name_of(pod: k8s.V1Pod) -> str:
    """A pod's name (always set on pods the API server returns, and on those `build_function_pod` makes)."""
    name = pod_meta(pod).name
    if name is None:
        raise ValueError("a pod without a name")
    return name


def pod_ip(pod: k8s.V1Pod) -> str | None:
    return pod.status.pod_ip if pod.status is not None else None


def pod_spec(pod: k8s.V1Pod) -> k8s.V1PodSpec:
    if pod.spec is None:
        raise ValueError(f"pod {pod_name_of(pod)} has no spec")
    return pod.spec


def pod_failure(pod: k8s.V1Pod) -> PodFailure | None:
    """Why a function pod will not serve, from its status; None while it is starting or running."""
    meta, status = pod_meta(pod), pod.status
    name = pod_name_of(pod)
    annotations = meta.annotations or {}
    labels = meta.labels or {}

    def failure(reason: str, message: str, exit_code: int | None = None) -> PodFailure:
        return PodFailure(
            labels.get(LABEL_FUNCTION, "?"),
            annotations.get(ANNOTATION_INSTANCE_ID, name),
            name,
            reason,
            message or reason,
            exit_code,
        )

    if status is None:
        return None
    if status.phase == "Failed" and status.reason:  # the kubelet's own verdict on the pod (Evicted, Shutdown, ...)
        exit_codes = [c.state.terminated.exit_code for c in status.container_statuses or []
                      if c.state is not None and c.state.terminated is not None]
        return failure(status.reason, status.message or "", exit_codes[0] if exit_codes else None)
    for init in status.init_container_statuses or []:  # e.g. the adapter fetch refused a damaged adapter
        waiting, done = (init.state.waiting, init.state.terminated) if init.state is not None else (None, None)
        if waiting is not None and waiting.reason in FAILED_WAITING_REASONS:  # its image first: the worker's
            return failure(waiting.reason, waiting.message or "")
        if done is not None and done.exit_code:
            return failure(done.reason or "Error", f"init container {init.name} exited with {done.exit_code}: "
                           f"{(done.message or '').strip() or 'no message'}", done.exit_code)
    for container in status.container_statuses or []:
        state = container.state
        if state is not None and state.waiting is not None and state.waiting.reason in FAILED_WAITING_REASONS:
            return failure(state.waiting.reason, state.waiting.message or "")
        if state is not None and state.terminated is not None:
            done = state.terminated
            return failure(
                done.reason or "Terminated", done.message or f"the worker exited with {done.exit_code}", done.exit_code
            )
    if status.phase in ("Failed", "Succeeded"):
        return failure(status.reason or status.phase, status.message or f"pod phase {status.phase}")
    return None


def pending_reason(pod: k8s.V1Pod | None) -> tuple[str, str]:
    if pod is None or pod.status is None:
        return "Pending", "no status yet"
    for condition in pod.status.conditions or []:
        if condition.type == "PodScheduled" and condition.status == "False":
            return condition.reason or "Unschedulable", condition.message or ""
    return pod.status.phase or "Pending", "the worker did not become ready"


def is_ready(pod: k8s.V1Pod) -> bool:
    status = pod.status
    if status is None or status.phase != "Running":
        return False
    return any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])
