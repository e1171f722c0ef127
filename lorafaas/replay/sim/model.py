"""The simulator's shared records: a function's queue and instances, an instance as its worker models it, and the
events of the fake clock. They sit below every module that reads or writes them (engine.py, worker.py,
admission.py, views.py), so none of those needs another's names to describe its state.

Events are typed records, one class per kind, pushed with their time (`Simulator.push`) and dispatched on their
class; ties in time go in the order they were pushed.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from lorafaas.replay.sim.cluster import FunctionSpec
from lorafaas.replay.sim.state import DeviceState
from lorafaas.scheduler import FunctionName


@dataclass
class DecodeRow:
    """A request decoding in an instance; `batch` counts the unfinished requests of the batch it was dispatched in
    (shared by them)."""

    index: int
    kv_bytes: int
    finish_step: float  # the instance's step count at which its last token comes
    batch: list[int]


@dataclass(eq=False)  # identity: instances live in sets and lists
class SimInstance:
    instance_id: str
    function: FunctionName
    device: DeviceState
    ready_at_s: float
    cold_start_s: float
    overhead_bytes: int
    running: int = 0  # batches with a request not yet finished
    last_used_s: float = 0.0
    expire_token: int = 0
    first_batch: bool = True
    permanent: bool = False  # serverful servers
    num_seqs: int = 0  # requests in it (waiting, prefilling or decoding): the agent's `in_flight`
    waiting: list[tuple[int, list[int]]] = field(default_factory=list)  # sent, not yet prefilled: (request, batch)
    pass_at_s: float | None = None  # the next prefill pass, when one is scheduled
    prefill_free_at_s: float = 0.0  # when the last prefill pass ends (decoding is paused until then)
    rows: list[DecodeRow] = field(default_factory=list)  # decoding
    steps: float = 0.0  # decode steps done
    step_s: float = 0.0  # one decode step now
    updated_s: float = 0.0  # `steps` is as of this time
    done_token: int = 0  # the current completion event (older ones are ignored)


@dataclass
class FunctionState:
    spec: FunctionSpec
    queue: deque[int] = field(default_factory=deque)
    instances: list[SimInstance] = field(default_factory=list)
    recheck_at_s: float = math.inf
    last_end_s: float | None = None
    blocked: bool = False
    dispatch_free_at_s: float = 0.0  # the agent's dispatcher awaits an instance's cold start until then


# -- events ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recheck:
    """Look at `function`'s queue again (a batch's timeout, a start awaited, a wait for a core running out)."""

    function: FunctionName


@dataclass(frozen=True)
class Prefill:
    """`instance`'s worker runs its next prefill pass."""

    instance: SimInstance


@dataclass(frozen=True)
class Observe:
    """The agent learns a prefill pass when its first tokens arrive (`Scheduler.observe_prefill`)."""

    function: FunctionName
    slo_ttft_s: float
    size: int
    pass_s: float


@dataclass(frozen=True)
class Done:
    """`instance`'s earliest last token is due; stale unless `token` is still its `done_token`."""

    instance: SimInstance
    token: int


@dataclass(frozen=True)
class Expire:
    """`instance`'s keep-alive ends; stale unless `token` is still its `expire_token`."""

    instance: SimInstance
    token: int


@dataclass(frozen=True)
class IdleRetire:
    """`function`, idle as a whole since `idle_since_s`, retires its least recently used idle instance."""

    function: FunctionName
    idle_since_s: float


@dataclass(frozen=True)
class PlanTick:
    """The periodic plan (it schedules the next)."""


@dataclass(frozen=True)
class Background:
    """The other programs' runnable threads changed (a sample of `Simulator`'s `background`)."""


SimEvent = Recheck | Prefill | Observe | Done | Expire | IdleRetire | PlanTick | Background
