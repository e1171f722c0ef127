"""The simulator's side of the admission policy: a function's queue described by the builder the node agent uses
(`lorafaas.scheduler.build_admission_view`), and `lorafaas.scheduler.decide_admission`'s decision carried out on
simulated instances. The lorafaas policies and their ablations admit this way; the baselines keep their own rules
(engine.py).
"""

from __future__ import annotations

from typing import Protocol, TypeVar

from lorafaas.replay.sim.cluster import ClusterSpec
from lorafaas.replay.sim.model import FunctionState, SimInstance
from lorafaas.replay.sim.policies import PolicySpec
from lorafaas.replay.sim.state import DeviceState, MemoryState
from lorafaas.replay.sim.views import ViewBuilder
from lorafaas.scheduler import (
    AdmissionDecision,
    AdmissionSettings,
    AdmissionView,
    ComputeTurns,
    FunctionName,
    InstanceId,
    InstanceLoad,
    Scheduler,
    StartOption,
    build_admission_view,
    decide_admission,
    worth_offering,
)

EPS_S = 1e-9


class AdmissionHost(Protocol):
    """What the admission side reads and calls of the simulator (`Simulator` is one)."""

    now: float
    cluster: ClusterSpec
    policy: PolicySpec
    scheduler: Scheduler
    mem: MemoryState
    views: ViewBuilder
    compute_slots: int
    blocked: dict[FunctionName, None]

    def busy(self, device: DeviceState) -> int: ...

    def start_on(self, name: FunctionName, fs: FunctionState, device: DeviceState, batch_size: int
                 ) -> SimInstance | None: ...

    def recheck(self, name: FunctionName, fs: FunctionState, at_s: float) -> None: ...

    def run_batch(self, inst: SimInstance, batch: list[int]) -> None: ...


class SimAdmission:
    def __init__(self, sim: AdmissionHost) -> None:
        self.sim = sim
        self.waits: dict[str, int] = {}  # reason -> times a queue had to wait for it (the report's "why it waited")
        # strict compute where the cluster says so (`device.strict_compute`), as the agent's --strict-compute:
        # functions waiting for a core take turns (on several devices the turns are the cluster's, a simplification)
        self.strict = sim.cluster.strict_compute and sim.policy.agent_admission
        self.turns = ComputeTurns()
        config = sim.scheduler.config
        self.settings = AdmissionSettings(
            worker_capacity=sim.cluster.max_batch_size, adaptive=sim.policy.batching == "adaptive",
            requests_per_background_start=config.requests_per_background_start, strict_compute=self.strict,
            max_compute_wait_s=config.max_compute_wait_s)

    def slo_batch(self, name: FunctionName, fs: FunctionState) -> int:
        policy = self.sim.policy
        if policy.batching == "fixed":  # the agent's fixed batch: B = the fixed size, not adapted
            return policy.fixed_batch_size
        return self.sim.scheduler.batch_policy(name, fs.spec.slo_ttft_s).max_batch_size

    def view(self, name: FunctionName, fs: FunctionState, queue_length: int,
             excluded: frozenset[str] = frozenset()) -> AdmissionView:
        """The function described as the agent describes it (`lorafaas.scheduler.build_admission_view`), from the
        simulated instances and devices."""
        sim = self.sim
        wait = self.turns.wait_of(name, sim.now)
        loads = tuple(InstanceLoad(InstanceId(i.instance_id), i.ready_at_s <= sim.now + EPS_S, i.num_seqs,
                                   i.ready_at_s - i.cold_start_s, sim.busy(i.device) < sim.compute_slots,
                                   any(o.function != name for o in i.device.instances))
                      for i in fs.instances)
        max_instances = sim.cluster.max_instances_per_function

        def options(joinable: bool) -> list[StartOption]:
            return [StartOption(device.device_id, sim.busy(device), sim.compute_slots,
                                sum(sim.views.start_delays(name, device).values()) if joinable else None)
                    for device in self._devices(name, len(loads), max_instances, excluded)]

        return build_admission_view(name, queue_length, fs.spec.slo_ttft_s, self.slo_batch(name, fs), max_instances,
                                    loads, sim.scheduler.steady(name), self.settings, wait, options,
                                    sim.scheduler.recent_arrivals(name, sim.now))

    def _devices(self, name: FunctionName, num_instances: int, max_instances: int, excluded: frozenset[str]) -> list:
        """The devices worth offering, in placement order. The placement (a view of memory) is asked only when one
        is: under load the cluster is saturated and the common case costs nothing."""
        sim = self.sim
        spare = [d for d in sim.mem.devices if d.device_id not in excluded
                 and worth_offering(num_instances, max_instances, sim.busy(d), sim.compute_slots)]
        if not spare:
            return []
        wanted = {d.device_id for d in spare}
        return [d for d in sim.views.candidate_devices(name) if d.device_id in wanted]

    def admit(self, name: FunctionName, fs: FunctionState, queue_length: int) -> bool:
        """Carry out one decision for `queue_length` of the queue's requests; True when requests went (the caller
        looks again), False when the queue waits (a recheck or a wake-up is arranged)."""
        sim = self.sim
        excluded: frozenset[str] = frozenset()
        while True:
            decision = decide_admission(self.view(name, fs, queue_length, excluded))
            self.turns.note(name, decision, sim.now)
            if decision.action == "start":
                device = sim.mem.by_id[_given(decision.device, "device")]
                instance = sim.start_on(name, fs, device, queue_length)
                if instance is None:  # no memory could be made there: the policy chooses again without it
                    excluded |= {device.device_id}
                    continue
                cap = min(self.slo_batch(name, fs), sim.cluster.max_batch_size)
                self._send(fs, instance, min(queue_length, cap))
                fs.dispatch_free_at_s = instance.ready_at_s  # the agent's dispatcher awaits the start
                return True
            return self._carry_out(name, fs, decision)

    def _carry_out(self, name: FunctionName, fs: FunctionState, decision: AdmissionDecision) -> bool:
        sim = self.sim
        by_id = {i.instance_id: i for i in fs.instances}
        if decision.action == "dispatch":
            if decision.device is not None:  # a slow start for the requests that follow: in the background
                sim.start_on(name, fs, sim.mem.by_id[decision.device], decision.size)
            self._send(fs, by_id[_given(decision.instance_id, "instance")], decision.size)
            return True
        self.waits[decision.reason] = self.waits.get(decision.reason, 0) + 1
        if decision.action == "await_start":
            sim.recheck(name, fs, by_id[_given(decision.instance_id, "instance")].ready_at_s)
        else:  # every instance is full and none can start: a request's end or freed memory wakes it
            fs.blocked = True
            sim.blocked[name] = None
            if decision.reason == "no_compute" and self.strict:  # or its wait for a core runs out
                max_wait_s = sim.scheduler.config.max_compute_wait_s
                sim.recheck(name, fs, sim.now + max_wait_s - self.turns.waited_s(name, sim.now))
        return False

    def _send(self, fs: FunctionState, instance: SimInstance, size: int) -> None:
        batch = [fs.queue.popleft() for _ in range(max(1, min(size, len(fs.queue))))]
        self.sim.run_batch(instance, batch)


T = TypeVar("T")


def _given(value: T | None, what: str) -> T:
    """What a decision of its action always names (a start its device; a dispatch or an await its instance)."""
    if value is None:
        raise ValueError(f"an admission decision without its {what}")
    return value
