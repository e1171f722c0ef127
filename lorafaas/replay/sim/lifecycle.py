"""Instances as the simulator starts, stops and retires them: cold starts (the artifacts a device lacks, slowed on a
CPU by what runs beside them), keep-alive expiry, the idle function's one-by-one retirement (`KeepAlivePolicy`, as
the agent's instances retire) and the serverful baseline's always-on servers.

`InstanceLifecycle` counts what the outcome reports of starts (cold starts and their breakdowns, the busiest device)
and reads and calls the simulator only through `LifecycleHost`.
"""

from __future__ import annotations

import itertools
from typing import Protocol

from lorafaas.replay.sim.cluster import ClusterSpec, FunctionSpec
from lorafaas.replay.sim.model import Expire, FunctionState, IdleRetire, SimEvent, SimInstance
from lorafaas.replay.sim.policies import PolicySpec
from lorafaas.replay.sim.state import DeviceState, MemoryState
from lorafaas.replay.sim.views import ViewBuilder
from lorafaas.scheduler import AdapterCostModel, FunctionName, IdleInstance, InstanceId, Scheduler, keep_within_budget


class LifecycleHost(Protocol):
    """What the instance lifecycle reads and calls of the simulator (`Simulator` is one)."""

    now: float
    fns: dict[FunctionName, FunctionState]
    cluster: ClusterSpec
    policy: PolicySpec
    scheduler: Scheduler
    mem: MemoryState
    views: ViewBuilder

    def push(self, at_s: float, event: SimEvent) -> None: ...

    def slowdown(self, device: DeviceState, starting: int = 0) -> float: ...

    def keep_alive_s(self, name: FunctionName) -> float: ...

    def retry_blocked(self) -> None: ...


class InstanceLifecycle:
    def __init__(self, sim: LifecycleHost) -> None:
        self.sim = sim
        self.num_cold_starts = self.busy_peak = 0
        self.cold_breakdowns: dict[str, list[dict[str, float]]] = {}
        self.instance_ids = itertools.count()
        self.num_budget_retirements = 0
        self.pricing = AdapterCostModel(sim.scheduler.config)
        self.priced: dict[FunctionName, FunctionSpec] = {}  # each function's spec as the scheduler prices it

    # -- starts -------------------------------------------------------------------------------------------------

    def start_baseline_instance(self, name: FunctionName, fs: FunctionState, batch_size: int) -> SimInstance | None:
        """A baseline's start: on the first device in its placement order where it fits, else where it made room."""
        sim = self.sim
        if len(fs.instances) >= sim.cluster.max_instances_per_function:
            return None
        candidates = sim.views.candidate_devices(name)
        for device in candidates:  # where it fits as things are, best first
            if sim.views.bytes_to_start(name, device, batch_size) <= sim.mem.free_bytes(device):
                return self.cold_start(name, fs, device)
        return self.start_on(name, fs, candidates[0], batch_size)

    def start_on(self, name: FunctionName, fs: FunctionState, device: DeviceState, batch_size: int
                 ) -> SimInstance | None:
        """Start an instance of `name` on `device` if it fits there, making room if needed; None if it cannot."""
        sim = self.sim
        need = sim.views.bytes_to_start(name, device, batch_size)
        if need <= sim.mem.free_bytes(device) or sim.views.make_room(name, device, need):
            return self.cold_start(name, fs, device)
        return None

    def busy(self, device: DeviceState) -> int:
        """Instances on `device` running a batch or starting (the agent's `InstanceTable.busy_on_device`)."""
        return sum(1 for i in device.instances if i.running or i.ready_at_s > self.sim.now)

    def note_busy(self, device: DeviceState) -> None:
        self.busy_peak = max(self.busy_peak, self.busy(device))

    def cold_start(self, name: FunctionName, fs: FunctionState, device: DeviceState) -> SimInstance:
        sim = self.sim
        breakdown = sim.views.load_artifacts(name, device)
        if sim.cluster.device_kind == "cpu":  # starting a process is CPU work: it shares the cores with the running
            slow = sim.slowdown(device, starting=1)
            breakdown = {stage: seconds * slow for stage, seconds in breakdown.items()}
        cold_s = sum(breakdown.values())
        breakdown["total"] = cold_s
        self.num_cold_starts += 1
        self.cold_breakdowns.setdefault(name, []).append(breakdown)
        overhead = sim.cluster.loading.instance_overhead_bytes
        sim.mem.bill(device, sim.now)
        device.used_bytes += overhead
        sim.mem.bill(device, sim.now)
        inst = SimInstance(
            f"{name}-{next(self.instance_ids)}", name, device, sim.now + cold_s, cold_s, overhead, last_used_s=sim.now
        )
        fs.instances.append(inst)
        device.instances.add(inst)
        self.note_busy(device)
        # an instance that never gets a batch (its requests went elsewhere while it started) idles out like any
        # other, from when it is ready; its first batch makes this stale (the agent's reconcile does the same)
        sim.push(inst.ready_at_s + sim.keep_alive_s(name), Expire(inst, inst.expire_token))
        return inst

    def start_servers(self) -> None:
        """Serverful: devices split over backbones by their share of functions; each device one always-on server
        holding its backbone and every adapter of it; a function's servers are those of its backbone."""
        self.sim.views.start_servers()

    # -- stops --------------------------------------------------------------------------------------------------

    def stop_instance(self, inst: SimInstance, keep_artifacts: bool) -> None:
        """`inst` stops and its overhead is freed; unless `keep_artifacts`, its function's artifacts on its device go
        too (and the host ones with the function's last instance). Views call it when they evict or offload."""
        sim = self.sim
        fs = sim.fns[inst.function]
        fs.instances.remove(inst)
        device = inst.device
        device.instances.discard(inst)
        sim.mem.bill(device, sim.now)
        device.used_bytes -= inst.overhead_bytes
        if not keep_artifacts:
            sim.views.drop_instance_artifacts(inst.function, device, last=not fs.instances)
        sim.mem.bill(device, sim.now)

    def on_expire(self, event: Expire) -> None:
        inst = event.instance
        if inst.running or inst.expire_token != event.token or inst not in self.sim.fns[inst.function].instances:
            return
        self.retire(inst)

    def retire(self, inst: SimInstance) -> None:
        """An idle instance stops (its artifacts stay where the policy plans them) and what waited for room retries."""
        policy = self.sim.policy
        self.stop_instance(inst, keep_artifacts=policy.preloading and policy.uses_scheduler_placement)
        self.sim.retry_blocked()

    def keep_within_budget(self, node: int) -> None:
        """The node's idle instances beyond its `idle_budget_bytes` retire, lowest expected saving per byte first
        (the scheduler's `keep_within_budget`, as the node agent's), each with its own artifacts on its device."""
        sim = self.sim
        budget = sim.cluster.idle_budget_bytes
        if budget is None or not sim.policy.uses_scheduler_placement or sim.policy.serverful:
            return
        idle = {InstanceId(i.instance_id): i for d in sim.mem.devices if d.node == node for i in d.instances
                if not i.permanent and not i.running and not i.num_seqs and i.ready_at_s <= sim.now}
        if not idle:
            return
        decision = keep_within_budget((self.idle_instance(i) for i in idle.values()), budget)
        for instance_id in decision.retire:
            self.num_budget_retirements += 1
            self.stop_instance(idle[instance_id], keep_artifacts=False)
        if decision.retire:
            sim.retry_blocked()

    def idle_instance(self, inst: SimInstance) -> IdleInstance:
        """`inst` as the budget prices it: its process, adapter and warm-up (priced as the scheduler sees adapters),
        the start they save (libraries, warm-up, the adapter from disk) and the rest of its keep-alive window."""
        sim = self.sim
        load = sim.cluster.loading
        spec = self.priced.get(inst.function)
        if spec is None:
            spec = self.priced[inst.function] = sim.views.costs.priced(sim.fns[inst.function].spec, self.pricing)
        rate = sim.scheduler.rates.rate(inst.function, sim.now) or sim.scheduler.config.rate_floor_per_s
        start_s = load.spawn_s + load.libraries_s + load.warmup_s + spec.adapter_bytes / load.disk_bytes_per_s
        window_s = max(0.0, inst.last_used_s + sim.keep_alive_s(inst.function) - sim.now)
        return IdleInstance(InstanceId(inst.instance_id), inst.function,
                            inst.overhead_bytes + spec.adapter_bytes + load.warmup_bytes, rate, start_s, window_s,
                            inst.last_used_s)

    def on_idle_retire(self, event: IdleRetire) -> None:
        """A function idle as a whole since `idle_since` retires its least recently used idle instance, then plans
        the next retirement; stale once it has run a batch since."""
        if self.idle_retire_stale(event):
            return
        sim = self.sim
        name, idle_since = event.function, event.idle_since_s
        fs = sim.fns[name]
        idle = sorted((i for i in fs.instances if not i.permanent and not i.running and i.ready_at_s <= sim.now),
                      key=lambda i: i.last_used_s)
        if not idle:
            return
        self.retire(idle[0])
        at_s = sim.scheduler.next_idle_retirement_s(name, idle_since, sim.now)
        if len(idle) > 1 and at_s is not None:
            sim.push(at_s, event)

    def idle_retire_stale(self, event: IdleRetire) -> bool:
        """The function ran a batch since it went idle, or has no idle instance left to retire."""
        name, idle_since = event.function, event.idle_since_s
        fs = self.sim.fns[name]
        return (fs.last_end_s != idle_since or bool(fs.queue) or any(i.running for i in fs.instances)
                or all(i.permanent for i in fs.instances))
