"""Adoption: the function pods a previous controller left. After a restart, `take_stock` deletes the failed ones and
hands each healthy one to the first `claim` by a launch of the same function, backbone and adapter, deleting those
nobody claims within `adopt_window_s`; `reconcile(wanted)` does the same for an explicit set of instances,
idempotently."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import msgspec
from kubernetes import client as k8s

from lorafaas.function_runtime.messages import WorkerSpec
from lorafaas.platform.backends.pod_instance import PodHost, PodInstance
from lorafaas.platform.backends.pod_status import (
    ANNOTATION_INSTANCE_ID,
    ANNOTATION_SPEC,
    is_ready,
    pod_failure,
    pod_ip,
    pod_meta,
    pod_name_of,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReconcileResult:
    adopted: tuple[str, ...] = ()  # instance ids
    created: tuple[str, ...] = ()
    deleted: tuple[str, ...] = ()  # pod names: orphans and failed pods


class AdoptionHost(PodHost, Protocol):
    """What adoption reads and calls of the backend (`KubernetesBackend` is one)."""

    def launch(self, spec: WorkerSpec, *, fresh: bool = False, timeout_s: float = 120.0) -> PodInstance: ...

    def list_function_pods(self) -> list[k8s.V1Pod]: ...


class PodAdoption:
    def __init__(self, backend: AdoptionHost) -> None:
        self.backend = backend
        self._lock = threading.Lock()
        self._adoptable: dict[str, k8s.V1Pod] = {}  # a previous controller's healthy pods, until claimed
        self._timer: threading.Timer | None = None

    def take_stock(self) -> None:
        """At start: delete the failed pods no instance of ours runs; the healthy ones wait `adopt_window_s` to be
        claimed."""
        backend = self.backend
        known = {i.pod_name for i in backend.instances}
        for pod in backend.list_function_pods():
            name = pod_name_of(pod)
            if name in known or pod_meta(pod).deletion_timestamp is not None:
                continue
            if pod_failure(pod) is not None:
                backend.delete_pod(name, grace_period_s=0)  # recorded by the watch
            else:
                self._adoptable[name] = pod
        if self._adoptable:
            log.info("found %d function pod(s) of a previous controller; adopting them as they are asked for "
                     "within %.0f s", len(self._adoptable), backend.config.adopt_window_s)
            self._timer = threading.Timer(backend.config.adopt_window_s, self.release_unclaimed)
            self._timer.daemon = True
            self._timer.start()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def drop(self, name: str) -> None:
        """The pod is gone: nothing to adopt."""
        with self._lock:
            self._adoptable.pop(name, None)

    def claim(self, spec: WorkerSpec) -> PodInstance | None:
        """A previous controller's healthy pod running exactly `spec` but for the instance id."""
        backend = self.backend
        with self._lock:
            for name in list(self._adoptable):
                pod = backend.cache.get(name)
                theirs = spec_of(pod) if pod is not None else None
                if (pod is None or theirs is None or pod_failure(pod) is not None
                        or pod_meta(pod).deletion_timestamp is not None):
                    del self._adoptable[name]
                    continue
                if (msgspec.structs.replace(theirs, instance_id=spec.instance_id) == spec and is_ready(pod)
                        and (ip := pod_ip(pod))):
                    del self._adoptable[name]
                    instance = PodInstance(theirs, name, ip, backend, adopted=True)
                    backend.instances.append(instance)
                    log.info("%s: adopted pod %s (instance %s) of a previous controller", spec.function, name,
                             theirs.instance_id)
                    return instance
        return None

    def waiting(self) -> list[WorkerSpec]:
        """The specs of the previous controller's healthy pods that no launch has claimed yet."""
        with self._lock:
            pods = [self.backend.cache.get(name) for name in self._adoptable]
        return [spec for pod in pods if pod is not None and (spec := spec_of(pod)) is not None]

    def release_unclaimed(self) -> list[str]:
        """Delete the previous controller's pods no launch claimed (functions deleted or scaled in meanwhile)."""
        with self._lock:
            unclaimed, self._adoptable = list(self._adoptable), {}
        for name in unclaimed:
            self.backend.delete_pod(name, grace_period_s=int(self.backend.config.delete_timeout_s))
        if unclaimed:
            log.info("deleted %d function pod(s) of a previous controller that no function claimed", len(unclaimed))
        return unclaimed

    def reconcile(self, wanted: Iterable[WorkerSpec], timeout_s: float = 120.0) -> ReconcileResult:
        """Make the function pods match `wanted` (by instance id): adopt the healthy ones, delete failed pods and
        orphans (pods of no wanted instance), create the missing. Calling it again changes nothing."""
        backend = self.backend
        wanted_by_id = {spec.instance_id: spec for spec in wanted}
        known = {instance.spec.instance_id for instance in backend.instances}
        adopted, deleted, present = [], [], set()
        for pod in backend.list_function_pods():  # starts the watch if it is not yet
            instance_id = (pod_meta(pod).annotations or {}).get(ANNOTATION_INSTANCE_ID)
            failure = pod_failure(pod)
            if instance_id not in wanted_by_id or failure is not None or pod_meta(pod).deletion_timestamp:
                if not pod_meta(pod).deletion_timestamp and backend.delete_pod(pod_name_of(pod), grace_period_s=0):
                    deleted.append(pod_name_of(pod))
                continue
            present.add(instance_id)
            if instance_id not in known and is_ready(pod) and (ip := pod_ip(pod)):
                backend.instances.append(PodInstance(wanted_by_id[instance_id], pod_name_of(pod), ip, backend,
                                                     adopted=True))
                adopted.append(instance_id)
            self.drop(pod_name_of(pod))
        created = []
        for instance_id, spec in wanted_by_id.items():
            if instance_id not in present:
                backend.launch(spec, timeout_s=timeout_s)
                created.append(instance_id)
        backend.instances = [i for i in backend.instances if i.spec.instance_id in wanted_by_id]
        if adopted or created or deleted:
            log.info("reconciled function pods: adopted %s, created %s, deleted %s", adopted, created, deleted)
        return ReconcileResult(tuple(adopted), tuple(created), tuple(deleted))

    def adoptable_specs(self) -> list[WorkerSpec]:
        """The WorkerSpecs of the function pods that exist (from their annotation)."""
        specs = []
        for pod in self.backend.list_function_pods():
            spec = spec_of(pod)
            if spec is not None:
                specs.append(spec)
        return specs


def spec_of(pod: k8s.V1Pod) -> WorkerSpec | None:
    """The WorkerSpec a function pod runs (its annotation); None if it has none that decodes."""
    raw = (pod_meta(pod).annotations or {}).get(ANNOTATION_SPEC)
    if raw is None:
        return None
    with contextlib.suppress(msgspec.ValidationError, msgspec.DecodeError, TypeError):
        return msgspec.json.decode(raw, type=WorkerSpec)
    return None
