"""What the pod watch records: function pods that failed (OOMKilled, evicted, unschedulable) or went without the
backend's asking (a drain, a node removed), kept per function for `describe`."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kubernetes import client as k8s

from lorafaas.platform.backends.pod_status import (
    ANNOTATION_INSTANCE_ID,
    LABEL_COMPONENT,
    LABEL_FUNCTION,
    PodFailure,
    pod_failure,
    pod_meta,
    pod_name_of,
)
from lorafaas.platform.descriptions import FailureView

log = logging.getLogger(__name__)

MAX_FAILURES_KEPT = 20  # per function


class PodFailures:
    """`observe` is the watch's callback (`PodCache(on_change=...)`); `on_gone(pod name)` hears of every function
    pod deleted, whoever deleted it."""

    def __init__(self, on_gone: Callable[[str], None]) -> None:
        self._on_gone = on_gone
        self._lock = threading.Lock()
        self._failures: dict[str, list[PodFailure]] = {}
        self._deleting: set[str] = set()  # pods the backend deletes: their going is no failure

    def expect_deletion(self, name: str) -> None:
        with self._lock:
            self._deleting.add(name)

    def observe(self, pod: k8s.V1Pod, deleted: bool) -> None:
        """In the watch thread: record function pods that failed, or went without our asking (a drain, an
        eviction, a node removed); the node agent sees their workers' connections close and starts replacements."""
        labels = pod_meta(pod).labels or {}
        if labels.get(LABEL_COMPONENT) != "function":
            return
        name = pod_name_of(pod)
        failure = pod_failure(pod)
        if failure is not None:
            self.record(failure)
        if deleted:
            with self._lock:
                ours = name in self._deleting
                self._deleting.discard(name)
            self._on_gone(name)
            if not ours and failure is None:
                self.record(PodFailure(
                    labels.get(LABEL_FUNCTION, "?"),
                    (pod_meta(pod).annotations or {}).get(ANNOTATION_INSTANCE_ID, name),
                    name, "Deleted", "the pod was deleted by someone else (kubectl drain or delete, an eviction, its "
                    "node removed); a replacement starts on the next request or reconcile"))

    def record(self, failure: PodFailure) -> bool:
        with self._lock:
            kept = self._failures.setdefault(failure.function, [])
            if any(f.pod == failure.pod and f.reason == failure.reason for f in kept):
                return False
            kept.append(failure)
            del kept[:-MAX_FAILURES_KEPT]
        log.warning("%s: pod %s failed: %s: %s", failure.function, failure.pod, failure.reason, failure.message)
        return True

    def describe(self, function: str, since: float = 0.0) -> list[FailureView]:
        with self._lock:
            return [failure.describe() for failure in self._failures.get(function, []) if failure.at >= since]

    def forget(self, function: str) -> None:
        with self._lock:
            self._failures.pop(function, None)
