"""Admission: what a function's queue does now. Send requests to an instance with room, start an instance, wait for
one that is starting, or wait.

One policy for every executor: the node agent (`lorafaas/platform/agent/`) and the simulator
(`lorafaas/replay/sim/admission.py`) describe the function through one builder (`admission_view.py`, each handing it
its own instances' loads and start options) and carry out the `AdmissionDecision`, so a decision seen in simulation
is the decision the agent makes.

The rule, in order:
1. An instance that is ready and holds fewer than min(B, worker capacity) requests takes up to that many (least
   loaded first, then one alone on its device, then the oldest): B keeps a batch's prefill within the SLO. An idle
   instance begins running only where its device has compute to spare, or as its function's one running instance
   (`_runnable`): busy instances are counted across functions, so a device never runs more of them than it has
   compute for, beyond one per function with requests. A function sent to an idle instance on a device other
   functions share also starts another instance in the background on the first device offered where compute is
   spare now (`_spare_device`) when that device's compute is taken (load-aware sharing: placement binds a busy copy
   of the backbone when no free device holds one) or, for a steady function (`AdmissionView.steady`), when that
   instance's is (another function's batch runs there): its next requests find an idle instance, preferably alone
   on its device, rather than a device another function keeps busy.
2. Otherwise, if the function may grow (fewer than `max_instances`), an instance starts on the first device offered
   where it helps: its first instance anywhere; another only where the device has compute to spare
   (`may_scale_out`) and, when a running batch could take the request instead or a start of it is under way (begun
   in the background: it serves sooner), only if the start is expected within the SLO (`start_beats_joining`).
3. Otherwise a ready instance whose worker still has room (`in_flight_limit`) takes them: joining a running batch
   costs a request less than waiting a whole generation for a place in B. If a start was held back only because it
   is slower than the SLO, it begins anyway in the background (`device`), one start under way per
   `requests_per_background_start` requests beyond B: these requests join now, the ones that follow find the new
   instances.
4. Otherwise the queue waits for an instance that is starting, or for a request to finish; the reason is reported.

Early scale-out: in a burst's first seconds (a function's first minutes among them) the rates do not yet say how
many instances it needs, and a start from disk takes longer than the instances take to fill. So when more requests
arrived within `SchedulerConfig.burst_window_s` (`AdmissionView.recent_arrivals`) than its instances take in their
batches (B each), rule 1 also starts one more instance in the background on the first device offered where compute
is spare (one start under way at a time): the burst's later requests find it ready instead of queueing behind it.

With `strict_compute` (a CPU, where a process beyond the cores only time-slices them and shrinks every batch) the
device never has more busy instances than compute slots, counted across functions, and functions take turns: an idle
instance begins running, and an instance starts, only where a slot is spare and no other function has waited for one
longer (`compute_waiting_ahead`); while another function waits (`compute_waiting_others`), a running instance takes
no new requests, so its batch drains within a generation and its slot passes on (`yield`), and a function taking its
turn takes what it has queued up to the worker's join limit, not only B (the rest would wait a whole round). A
function that has waited `max_compute_wait_s` for a core is overdue: it runs beside the busy instances anyway
(`overdue`), so one tenant's long generations delay another's first token by a bounded time. Without strict compute
(a GPU in the simulator, one slot each) every function may run one instance on a full device, as rule 1 says.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from lorafaas.scheduler.batching import in_flight_limit
from lorafaas.scheduler.messages import DeviceId, FunctionName, InstanceId
from lorafaas.scheduler.placement import may_scale_out, start_beats_joining

AdmissionAction = Literal["dispatch", "start", "await_start", "wait"]
# Why requests were sent where they were, or why they wait (shown by `describe` and the simulator's report).
AdmissionReason = Literal[
    "room",  # an instance had room within B
    "join",  # joined a running batch beyond B: no instance could start
    "first_instance",  # the function had no instance
    "scale_out",  # every instance held B and the device had compute to spare
    "cold_start",  # waiting for an instance that is starting
    "batch_bound",  # every instance holds as many requests as its worker takes
    "max_instances",  # the function is at its maximum number of instances
    "no_compute",  # no device offered has compute to spare for another instance
    "yield",  # strict compute: its running instance takes no more while another function waits for the device
    "overdue",  # strict compute: it waited max_compute_wait_s for a core and runs beside the busy instances anyway
    "empty",  # nothing queued
]


@dataclass(frozen=True)
class InstanceLoad:
    """One instance of the function (of the identity the queue serves), as admission sees it."""

    instance_id: InstanceId
    ready: bool  # False: still starting
    in_flight: int  # requests it holds
    started_s: float  # when it began starting (the older instance wins a tie)
    # its device runs fewer busy instances (of every function: running a request or starting) than it has compute
    # slots; an idle instance whose device is full begins running only as its function's one running instance
    spare_compute: bool = True
    shares_device: bool = False  # another function has an instance on its device (it may contend for compute)


@dataclass(frozen=True)
class StartOption:
    """A device where an instance of the function could start, in the executor's order of preference."""

    device: DeviceId
    busy_instances: int  # instances on the device (of every function) running a request or starting
    compute_slots: int  # how many can run at full speed at once
    expected_start_s: float | None = None  # how long a start there is expected to take; None: not known


@dataclass(frozen=True)
class AdmissionView:
    function: FunctionName
    queue_length: int
    slo_ttft_s: float
    slo_batch: int  # B: the batch policy's largest batch within the SLO (or the fixed batch size)
    worker_capacity: int  # the most requests one worker batches
    adaptive: bool  # adaptive batching on (off: B is a hard limit, nothing joins beyond it)
    max_instances: int
    instances: tuple[InstanceLoad, ...]  # starting or ready, of the identity the queue serves
    start_options: tuple[StartOption, ...] = ()  # empty: no instance may start (e.g. a superseded version)
    requests_per_background_start: int = 4  # SchedulerConfig.requests_per_background_start
    # strict compute: busy instances never exceed compute slots, and functions waiting for a slot take turns
    strict_compute: bool = False
    compute_waiting_others: int = 0  # other functions waiting for a compute slot on the device
    compute_waiting_ahead: int = 0  # of those, how many began waiting before this function (all, if it does not wait)
    compute_waited_s: float = 0.0  # how long this function has waited for a core
    max_compute_wait_s: float = 10.0  # SchedulerConfig.max_compute_wait_s
    recent_arrivals: int = 0  # arrivals within SchedulerConfig.burst_window_s (`Scheduler.recent_arrivals`)
    steady: bool = False  # its arrivals are steady (`Scheduler.steady`): on a shared device another function keeps
    # busy it gets a spare instance (any function does where all its instances' devices are taken)


@dataclass(frozen=True)
class AdmissionDecision:
    action: AdmissionAction
    reason: AdmissionReason
    instance_id: InstanceId | None = None  # dispatch, await_start
    # start; with a join (or a steady function's dispatch to a shared device): an instance to start there in the
    # background
    device: DeviceId | None = None
    size: int = 0  # dispatch: how many of the queue's requests go now


def worth_offering(num_instances: int, max_instances: int, busy_instances: int, compute_slots: int) -> bool:
    """Whether an executor should describe a device as a `StartOption` at all: the policy skips it otherwise."""
    return num_instances < max_instances and may_scale_out(num_instances, busy_instances, compute_slots)


def needs_start_options(instances: tuple[InstanceLoad, ...], slo_batch: int, worker_capacity: int,
                        steady: bool = False, recent_arrivals: int = 0) -> bool:
    """Whether the decision can depend on where an instance could start: not while a ready instance has room within
    B (executors skip working the options out then; finding a device can cost a view of the cluster), unless every
    instance shares its device and the function is steady or no ready instance has compute to spare, or a burst
    outgrows its instances (early scale-out)."""
    if all(i.shares_device for i in instances) and (steady or not any(i.spare_compute for i in instances if i.ready)):
        return True
    cap = max(1, min(slo_batch, max(1, worker_capacity)))
    if _bursting(len(instances), recent_arrivals, cap):
        return True
    return not any(i.in_flight < cap for i in _runnable([i for i in instances if i.ready], strict=False))


def join_limit(slo_batch: int, worker_capacity: int, adaptive: bool) -> int:
    """How many requests a ready instance may hold when a request joins it because no instance can start."""
    capacity = max(1, worker_capacity)
    return min(in_flight_limit(slo_batch, capacity, False, adaptive), capacity)


def can_join(instances: tuple[InstanceLoad, ...], slo_batch: int, worker_capacity: int, adaptive: bool) -> bool:
    """Whether a running batch could take a request instead of a start (then a start's expected time matters)."""
    limit = join_limit(slo_batch, worker_capacity, adaptive)
    return any(i.in_flight < limit for i in _runnable([i for i in instances if i.ready], strict=False))


def decide_admission(view: AdmissionView) -> AdmissionDecision:
    if view.strict_compute and view.compute_waited_s >= view.max_compute_wait_s:
        decision = _decide(replace(view, strict_compute=False))
        if decision.action in ("dispatch", "start"):
            return replace(decision, reason="overdue")
        return decision
    return _decide(view)


def _decide(view: AdmissionView) -> AdmissionDecision:
    if view.queue_length <= 0:
        return AdmissionDecision("wait", "empty")
    capacity = max(1, view.worker_capacity)
    cap = max(1, min(view.slo_batch, capacity))
    ready = [i for i in view.instances if i.ready]
    strict = view.strict_compute
    runnable = _runnable(ready, strict, yielding=strict and view.compute_waiting_others > 0,
                         turn=not strict or view.compute_waiting_ahead == 0)
    with_room = [i for i in runnable if i.in_flight < cap]
    limit = join_limit(view.slo_batch, capacity, view.adaptive)
    if with_room:
        best = _least_loaded(with_room)
        room = cap - best.in_flight
        if strict and view.compute_waiting_others > 0:  # a turn: what is queued now goes in it (up to the join
            room = max(room, limit - best.in_flight)  # limit), or it would wait a whole round of other turns
        # load-aware sharing: no instance of it computes alone, all share devices other functions keep busy
        contended = all(i.shares_device and not i.spare_compute for i in ready)
        # a steady function's spare only while another function's batch keeps that device busy now: on an idle
        # shared device a spare only churns (started, idle to its window, started again: Predictable's 1,867 starts)
        wants_spare = best.shares_device and best.in_flight == 0 and (
            contended or (view.steady and not best.spare_compute))
        if wants_spare or _bursting(len(view.instances), view.recent_arrivals, cap):
            spare = _spare_device(view)
        else:
            spare = None
        return AdmissionDecision("dispatch", "room", best.instance_id, device=spare,
                                 size=min(view.queue_length, room))
    joinable = [i for i in runnable if i.in_flight < limit]
    can_grow = len(view.instances) < view.max_instances
    slow_start: DeviceId | None = None
    # a start under way (begun in the background) serves sooner than a slow one begun now: the queue awaits it
    under_way = any(not i.ready for i in view.instances)
    if can_grow and (not strict or view.compute_waiting_ahead == 0):
        for option in view.start_options:
            if not may_scale_out(len(view.instances), option.busy_instances, option.compute_slots):
                continue
            if strict and option.busy_instances >= option.compute_slots:  # not even a first instance
                continue
            if (joinable or under_way) and not start_beats_joining(option.expected_start_s, view.slo_ttft_s):
                slow_start = slow_start or (option.device if joinable else None)
                continue
            reason: AdmissionReason = "scale_out" if view.instances else "first_instance"
            return AdmissionDecision("start", reason, device=option.device)
    if joinable:
        best = _least_loaded(joinable)
        size = min(view.queue_length, limit - best.in_flight)
        # Joining beyond B is a stopgap: a start slower than the SLO still adds capacity for what follows, so it
        # begins now, in the background, while these requests join: one start under way per
        # `requests_per_background_start` requests beyond B.
        excess = sum(i.in_flight for i in ready) + view.queue_length - cap * len(ready)
        wanted = max(1, -(-excess // view.requests_per_background_start))
        if sum(1 for i in view.instances if not i.ready) >= wanted:
            slow_start = None
        return AdmissionDecision("dispatch", "join", best.instance_id, device=slow_start, size=size)
    starting = [i for i in view.instances if not i.ready]
    if starting:
        oldest = min(starting, key=lambda i: (i.started_s, i.instance_id))
        return AdmissionDecision("await_start", "cold_start", oldest.instance_id)
    if strict and view.compute_waiting_others > 0 and any(i.in_flight > 0 for i in ready):
        return AdmissionDecision("wait", "yield")
    if len(runnable) < len(ready):  # an idle instance waits for compute other instances hold
        return AdmissionDecision("wait", "no_compute")
    if not can_grow:
        return AdmissionDecision("wait", "max_instances")
    if ready:
        return AdmissionDecision("wait", "batch_bound")
    return AdmissionDecision("wait", "no_compute")


def _runnable(ready: list[InstanceLoad], strict: bool, yielding: bool = False, turn: bool = True
              ) -> list[InstanceLoad]:
    """The ready instances that may take requests now: those already running (unless they yield to a function waiting
    for the device), and an idle one only where its device has compute to spare (strictly: and it is the function's
    turn) or, not strictly, as its function's one running instance (every function may run one; another instance of
    it would only share cores that are already taken, shrinking every batch on the device)."""
    running = [] if yielding else [i for i in ready if i.in_flight > 0]
    idle = [i for i in ready if i.in_flight == 0]
    allowed = [i for i in idle if i.spare_compute and turn]
    if not strict and not running and not allowed and idle:
        allowed = [min(idle, key=lambda i: (i.started_s, i.instance_id))]
    return running + allowed


def _bursting(num_instances: int, recent_arrivals: int, cap: int) -> bool:
    """Early scale-out: more arrivals within the burst window than the function's instances take in their batches."""
    return num_instances > 0 and recent_arrivals > num_instances * cap


def _spare_device(view: AdmissionView) -> DeviceId | None:
    """For a function about to run on an instance whose device other functions share (and keep busy, unless it is
    steady): the first device offered where compute is spare now, to start another instance there in the background.
    None while one of its instances is starting, at `max_instances`, or when no device has compute to spare."""
    if len(view.instances) >= view.max_instances or any(not i.ready for i in view.instances):
        return None
    return next((o.device for o in view.start_options if o.busy_instances < o.compute_slots), None)


def _least_loaded(instances: list[InstanceLoad]) -> InstanceLoad:
    """One on a device that other functions do not keep busy first (load-aware sharing); then fewest requests; then
    an instance alone on its device (no other function's batches to contend with); then the oldest."""
    return min(instances, key=lambda i: (i.shares_device and not i.spare_compute, i.in_flight, i.shares_device,
                                         i.started_s, i.instance_id))
