"""Everything the node agent knows of one deployed function, in one record.

A `FunctionState` is created when a deployment is applied and dropped when it is removed or replaced by a new
deployment under the same name; every per-function figure the agent keeps (cold starts, failures, admission, its
adapter's size, the artifacts' load times, offloads) lives here, so nothing of a deleted function outlives it: a
same-name redeploy, maybe by another tenant, starts from an empty record. Work of the old deployment still draining
writes into the old record, which nobody reads any more.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from lorafaas.platform.descriptions import FailureView, OffloadView
from lorafaas.platform.state.records import FunctionSpec
from lorafaas.scheduler import AdmissionDecision, FunctionName

MAX_FAILURES_KEPT = 20  # per function, for describe
FAILURE_KINDS = ("crashed", "hung", "start_failed")


@dataclass(frozen=True)
class FailureRecord:
    """An instance that crashed, hung or failed to start."""

    instance_id: str
    pid: int | None
    reason: str
    version: int
    at: float  # unix time

    @property
    def kind(self) -> str:
        return "hung" if self.reason.startswith("hung") else \
            "start_failed" if self.reason.startswith("start") else "crashed"

    def describe(self) -> FailureView:
        return FailureView(instance_id=self.instance_id, pid=self.pid, reason=self.reason, version=self.version,
                           at=self.at)


@dataclass(frozen=True)
class OffloadEvent:
    """An artifact the agent moved off the device to make room (or dropped)."""

    kind: str
    from_tier: str
    to_tier: str | None
    at: float  # unix time
    reason: str

    def describe(self) -> OffloadView:
        return OffloadView(kind=self.kind, from_tier=self.from_tier, to_tier=self.to_tier or "dropped", at=self.at,
                           reason=self.reason)


@dataclass
class FunctionState:
    spec: FunctionSpec  # the current version of the deployment
    adapter_bytes: int = 0  # its adapter's weights, read when the deployment (or a new adapter) was applied
    last_cold_start: dict[str, float] | None = None  # the steps of its last instance start, in seconds
    registration: dict[str, float] | None = None  # the stages of its deployment's registration, in seconds
    last_scale_out_s: float | None = None  # a start beside a running instance: what the next one expects
    cold_starts: dict[str, int] = field(default_factory=dict)  # kind -> count
    restarts: int = 0  # instances replaced after a crash or hang
    most_in_flight: int = 0  # most requests one instance has held at once
    failures: list[FailureRecord] = field(default_factory=list)  # recent last, at most MAX_FAILURES_KEPT
    failure_counts: dict[str, int] = field(default_factory=dict)  # crashed | hung | start_failed -> count
    last_admission: AdmissionDecision | None = None  # the admission policy's last word
    waits: dict[str, int] = field(default_factory=dict)  # reason -> times its queue looked and had to wait
    idle_retired_s: float | None = None  # when its last stepped idle retirement happened (agent clock)
    in_flight_tokens: int = 0  # estimated tokens of its requests running
    last_end_s: float | None = None  # when it last became idle (agent clock)
    load_s: dict[str, float] = field(default_factory=dict)  # artifact kind -> seconds its last start took
    offloads: list[OffloadEvent] = field(default_factory=list)

    @property
    def name(self) -> FunctionName:
        return FunctionName(self.spec.name)

    def owns(self, uid: str) -> bool:
        """Whether work of deployment `uid` belongs to this record (not to a deleted namesake)."""
        return self.spec.uid == uid

    def record_failure(self, instance_id: str, pid: int | None, reason: str, version: int) -> FailureRecord:
        record = FailureRecord(instance_id, pid, reason, version, time.time())
        self.failure_counts[record.kind] = self.failure_counts.get(record.kind, 0) + 1
        self.failures.append(record)
        del self.failures[:-MAX_FAILURES_KEPT]
        return record

    def record_cold_start(self, kind: str, steps: dict[str, float], scale_out: bool) -> None:
        self.cold_starts[kind] = self.cold_starts.get(kind, 0) + 1
        self.last_cold_start = dict(steps)
        if scale_out:  # a first start may also start the backbone's daemon; a scale-out binds to it
            self.last_scale_out_s = steps["total"]
        for artifact in ("backbone", "adapter", "warmup"):
            if artifact in steps:
                self.load_s[artifact] = steps[artifact]

    def record_wait(self, reason: str) -> None:
        self.waits[reason] = self.waits.get(reason, 0) + 1
