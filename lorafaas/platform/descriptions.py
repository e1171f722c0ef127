"""What `describe` shows of a function (GET /v1/functions/NAME, `lorafaas describe`), as typed structs: built by the
node agent (lorafaas/platform/agent/views.py) from its record, the instance table and the backend, encoded by the
gateway, decoded by the CLI."""

from __future__ import annotations

import msgspec

from lorafaas.function_runtime.messages import AdapterStats
from lorafaas.platform.state.records import FunctionSpec


class InstanceView(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One instance of a function (`reason` only when it has one)."""

    instance_id: str
    pid: int | None
    device: str
    state: str
    version: int
    deployment: str
    in_flight: int
    started_at: float
    loaded: list[str]
    cold_start: dict[str, float]
    adapter: AdapterStats | None  # None until its start loaded the adapter
    shared_base: bool
    reason: str = ""


class OffloadView(msgspec.Struct, kw_only=True):
    kind: str
    from_tier: str = msgspec.field(name="from")
    to_tier: str = msgspec.field(name="to")  # "dropped" when it left every tier
    at: float
    reason: str


class BatchingView(msgspec.Struct, kw_only=True):
    max_batch_size: int
    prefill_t0_s: float
    prefill_per_request_s: float
    prefills_observed: int
    most_in_flight: int


class AdmissionView(msgspec.Struct, kw_only=True):
    queued: int
    last_decision: str | None
    reason: str | None
    waits: dict[str, int]


class FailureView(msgspec.Struct, kw_only=True):
    """An instance that failed, as the agent saw it (a process that crashed, hung or failed to start: `pid` and
    `version`) or as the backend saw it (a pod: `pod`, `message` and `exit_code`). A field of the other source is
    absent, not null (UNSET), so each keeps the JSON it always had; the field order keeps each one's key order."""

    instance_id: str
    pid: int | msgspec.UnsetType | None = msgspec.UNSET  # agent
    pod: str | msgspec.UnsetType = msgspec.UNSET  # backend
    reason: str  # agent: "crashed: ...", "hung ...", "start ..."; backend: e.g. OOMKilled, Evicted, Unschedulable
    version: int | msgspec.UnsetType = msgspec.UNSET  # agent
    message: str | msgspec.UnsetType = msgspec.UNSET  # backend
    exit_code: int | msgspec.UnsetType | None = msgspec.UNSET  # backend
    at: float  # unix time


class FunctionDescription(msgspec.Struct, kw_only=True):
    """The function's spec and its life on the node: its instances, last cold start, offloads, batching decision (B
    and the fitted prefill model T(b) = T0 + a(b-1) it comes from), admission (the policy's last word and why
    requests waited), cold starts by kind and failures (the agent's, then the backend's)."""

    function: FunctionSpec
    instances: list[InstanceView]
    last_cold_start: dict[str, float] | None
    offloaded: list[OffloadView]
    batching: BatchingView
    admission: AdmissionView
    cold_starts: dict[str, int]
    failures: list[FailureView]
    registration: dict[str, float] | None = None  # its deployment's registration by stage (check, adapter, state)
