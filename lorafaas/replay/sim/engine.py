"""Discrete-event simulation of a serverless LoRA cluster driving the real `lorafaas.scheduler` policies.

The simulator is an executor like the node agent: it feeds the `Scheduler` what happened (`observe_arrival`,
`observe_prefill` when a first token comes, `observe_idle`), asks it what to do (`batch_policy` for B on each
dispatch, `decide_batch` only under fill-or-expire, `decide_admission` for where a queue's requests go
(admission.py: the same policy and the same view as the node agent's), `place` for a new instance, `make_room` when
a new instance does not fit, `keep_alive` after an invocation, `plan` every `plan_interval_s` or when
`should_replan`), and
applies the decisions to its state with a fake clock and the cost model. Baselines that
are not lorafaas (ServerlessLLM, InstaInfer, serverful) switch mechanisms off or replace them (fast loader, locality
placement, LRU eviction, fixed keep-alive, always-on servers); see `policies.py`.

One request: arrival -> its function's queue -> a batch is dispatched (by the policy's batching) to an instance with
room (or a new one: cold start = the sum of the delays of its artifacts not yet resident; or, when none can start,
a running batch it may join) -> the instance's worker (`worker.py`): its next prefill pass (TTFT) -> decoding at
the rate the device's load allows as it changes, every request leaving its instance after its own output tokens.
Nothing here reads a clock or depends on set order: the same seed gives the same metrics in every process.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from lorafaas.errors import ClusterInvalid
from lorafaas.replay.results import RequestResult
from lorafaas.replay.sim.admission import SimAdmission
from lorafaas.replay.sim.cluster import ClusterSpec
from lorafaas.replay.sim.costmodel import CostModel
from lorafaas.replay.sim.lifecycle import InstanceLifecycle
from lorafaas.replay.sim.model import (
    Background,
    Done,
    Expire,
    FunctionState,
    IdleRetire,
    Observe,
    PlanTick,
    Prefill,
    Recheck,
    SimEvent,
    SimInstance,
)
from lorafaas.replay.sim.policies import PolicySpec
from lorafaas.replay.sim.state import DeviceState, MemoryState
from lorafaas.replay.sim.views import ViewBuilder
from lorafaas.replay.sim.worker import WorkerModel
from lorafaas.replay.workload import Workload
from lorafaas.scheduler import (
    DeviceId,
    FunctionName,
    Scheduler,
    SchedulerConfig,
    for_device_kind,
)


@dataclass
class SimOutcome:
    results: list[RequestResult]
    cost: float
    duration_s: float
    num_cold_starts: int
    num_plans: int
    cold_breakdowns: dict[str, list[dict[str, float]]]
    waits: dict[str, int] = field(default_factory=dict)  # admission reason -> times a function's queue waited for it
    busy_peak: int = 0  # the most instances busy at once on one device (running a batch or starting)
    plan_times_s: list[float] = field(default_factory=list)  # wall time of each `Scheduler.plan` (not simulated)
    budget_retirements: int = 0  # idle instances retired because their node's idle budget was full


class Simulator:
    def __init__(
        self,
        cluster: ClusterSpec,
        policy: PolicySpec,
        workload: Workload,
        seed: int = 0,
        background: Sequence[tuple[float, float]] = (),
    ) -> None:
        """`background`: (time s, runnable threads of other programs) from then on, e.g. measured by
        `lorafaas.replay.cpuload` during a live run (a CPU device with `cores` shares them)."""
        self.cluster, self.policy, self.workload = cluster, policy, workload
        if policy.shared_base and cluster.shared_base is None:
            raise ClusterInvalid(f"policy {policy.name!r} runs the shared base pass, and cluster {cluster.name!r} has "
                                 "no model of it (device.shared_base: a CPU cluster's, e.g. `local`)")
        samples = sorted(background)
        self.background_at_s = [t for t, _ in samples]
        self.background_threads = [max(0.0, b) for _, b in samples]
        self.costs = CostModel(cluster)
        self.rng = random.Random(seed)
        config = for_device_kind(SchedulerConfig(
            preloading=policy.preloading,
            offloading=policy.offloading,
            keep_alive_policy=policy.keep_alive,
            fixed_keep_alive_s=cluster.keep_alive_s,
            max_batch_size=cluster.max_batch_size,
            rank_aware=policy.rank_aware,
        ), cluster.device_kind)
        self.scheduler = Scheduler(config, random.Random(seed))
        self.fns: dict[FunctionName, FunctionState] = {}
        for i, name in enumerate(workload.functions):
            self.fns[FunctionName(name)] = FunctionState(cluster.function(name, i))
        devices = [
            DeviceState(DeviceId(f"n{n}-d{k}"), n, cluster.device_memory_bytes)
            for n in range(cluster.num_nodes)
            for k in range(cluster.devices_per_node)
        ]
        backbone_of = {
            f: (s.spec.backbone if policy.sharing else f"{s.spec.backbone}@{f}") for f, s in self.fns.items()
        }
        sizes = {
            (f, kind): self.costs.device_bytes(kind, s.spec)
            for f, s in self.fns.items()
            for kind in ("backbone", "adapter", "warmup", "libraries")
        }
        self.mem = MemoryState(devices, cluster.price, backbone_of, sizes)
        self.views = ViewBuilder(self, cluster, self.costs)
        self.admission = SimAdmission(self)
        self.worker = WorkerModel(self)
        self.lifecycle = InstanceLifecycle(self)
        self.now = 0.0
        self.events: list[tuple[float, int, SimEvent]] = []
        self.seq = itertools.count()
        self.results = [
            RequestResult(i, r.function, r.trace_function, r.arrival_s, r.prompt_tokens, r.output_tokens)
            for i, r in enumerate(workload.requests)
        ]
        self.num_plans = 0
        self.plan_times_s: list[float] = []
        self.last_plan_s = -math.inf
        self.host_cache: dict[int, dict[str, None]] = {n: {} for n in range(cluster.num_nodes)}  # ServerlessLLM
        self.blocked: dict[FunctionName, None] = {}  # functions waiting for room, in the order they blocked
        # the agent's compute slots: a CPU's cores / one thread per instance; a GPU runs one instance's kernels at once
        self.compute_slots = cluster.compute_slots or (max(1, int(cluster.cores)) if cluster.cores is not None else 1)
        self.concurrency = (
            cluster.serverful_max_concurrent_batches
            if policy.batching == "immediate"
            else cluster.max_concurrent_batches
        )

    # -- event loop ---------------------------------------------------------------------------------------------

    def background_threads_now(self) -> float:
        i = bisect.bisect_right(self.background_at_s, self.now) - 1
        return self.background_threads[i] if i >= 0 else 0.0

    def slowdown(self, device: DeviceState, starting: int = 0) -> float:
        """How much slower work on `device` runs now: its running instances (and `starting` more) and, on a CPU,
        the other programs' runnable threads."""
        return self.costs.contention(device.num_running + starting, self.background_threads_now())

    def pass_slowdown(self, device: DeviceState) -> float:
        """How much slower a prefill pass starting now on `device` runs (`CostModel.pass_contention`)."""
        return self.costs.pass_contention(device.num_running, self.background_threads_now())

    def decode_slowdown(self, device: DeviceState) -> float:
        """How much slower decoding on `device` runs now, beside the passes under way there."""
        passing = sum(1 for inst in device.decoding if inst.prefill_free_at_s > self.now)
        return self.costs.decode_contention(device.num_running, passing, self.background_threads_now())

    def _on_background(self) -> None:
        for device in self.mem.devices:  # the cores' share moved: decoding goes on at the new rate
            self.worker.retime(device)

    def push(self, at_s: float, event: SimEvent) -> None:
        heapq.heappush(self.events, (at_s, next(self.seq), event))

    def _handle(self, event: SimEvent) -> None:
        if isinstance(event, Done):
            self._on_done(event)
        elif isinstance(event, Prefill):
            self.worker.on_prefill(event.instance)
        elif isinstance(event, Observe):
            self.scheduler.observe_prefill(event.function, event.slo_ttft_s, event.size, event.pass_s)
            if self.cluster.step_gate:  # the pass gave its core back: decoding goes on at the new rate
                self._on_background()
        elif isinstance(event, Recheck):
            self._on_recheck(event)
        elif isinstance(event, Expire):
            self.lifecycle.on_expire(event)
        elif isinstance(event, IdleRetire):
            self.lifecycle.on_idle_retire(event)
        elif isinstance(event, PlanTick):
            self._on_plan(tick=True)
        else:  # Background, the last kind of `SimEvent`
            self._on_background()

    def run(self) -> SimOutcome:
        for at_s in self.background_at_s:
            self.push(at_s, Background())
        if self.policy.serverful:
            self.lifecycle.start_servers()
        elif self.policy.preloading:
            self.now = -self.cluster.deploy_lead_s  # the deploy's plan, before the trace's first arrival
            self.push(self.now, PlanTick())
        requests = self.workload.requests
        i = 0
        while i < len(requests) or self.events:
            if i < len(requests) and (not self.events or requests[i].arrival_s <= self.events[0][0]):
                self.now = requests[i].arrival_s
                self._on_arrival(i)
                i += 1
                continue
            at, _, event = heapq.heappop(self.events)
            if isinstance(event, PlanTick) and i >= len(requests):
                continue  # no more arrivals: stop planning
            if isinstance(event, IdleRetire) and self.lifecycle.idle_retire_stale(event):
                continue  # nothing to retire: it must not move the clock (nor the end the cost is billed to)
            self.now = max(self.now, at)
            self._handle(event)
        end = max(self.now, self.workload.duration_s)
        cost = self._finish(end)
        lifecycle = self.lifecycle
        return SimOutcome(self.results, cost, end, lifecycle.num_cold_starts, self.num_plans,
                          lifecycle.cold_breakdowns, dict(self.admission.waits), lifecycle.busy_peak,
                          self.plan_times_s, lifecycle.num_budget_retirements)

    def _finish(self, end_s: float) -> float:
        if self.policy.serverful:
            return (
                self.cluster.num_devices
                * self.cluster.device_memory_bytes
                / 1e9
                * end_s
                * self.cluster.price.gpu_active_per_gb_s
                + len(self.results) * self.cluster.price.per_request
            )
        return self.mem.total_cost(end_s) + len(self.results) * self.cluster.price.per_request

    # -- arrivals and batching ----------------------------------------------------------------------------------

    def _on_arrival(self, index: int) -> None:
        name = FunctionName(self.results[index].function)
        fs = self.fns[name]
        if fs.last_end_s is not None and not fs.queue and not any(inst.running for inst in fs.instances):
            self.scheduler.observe_idle(name, max(0.0, self.now - fs.last_end_s))
            fs.last_end_s = None
        self.scheduler.observe_arrival(name, self.now)
        fs.queue.append(index)
        self._pump(name)
        if (
            self.policy.preloading
            and self.now - self.last_plan_s >= self.cluster.min_replan_s
            and self.scheduler.should_replan(self.now)
        ):
            self._on_plan(tick=False)

    def _on_recheck(self, event: Recheck) -> None:
        name = event.function
        fs = self.fns[name]
        if fs.recheck_at_s <= self.now + 1e-9:
            fs.recheck_at_s = math.inf
            self._pump(name)

    def recheck(self, name: FunctionName, fs: FunctionState, at_s: float) -> None:
        if at_s < fs.recheck_at_s - 1e-9:
            fs.recheck_at_s = at_s
            self.push(at_s, Recheck(name))

    def _batch_size(self, name: FunctionName, fs: FunctionState) -> int:
        """How many to dispatch now (0: wait; a recheck is scheduled)."""
        n = len(fs.queue)
        oldest_wait = self.now - self.results[fs.queue[0]].arrival_s
        policy = self.policy
        if policy.batching == "immediate":
            return min(n, self.cluster.max_batch_size)
        if policy.batching == "fixed":
            if n >= policy.fixed_batch_size or oldest_wait >= policy.fixed_batch_timeout_s - 1e-9:
                return min(n, policy.fixed_batch_size)
            recheck = self.now + policy.fixed_batch_timeout_s - oldest_wait
        elif not policy.fill_or_expire:  # the agent's default: the whole queue at once; admission sizes each part
            return n
        else:
            decision = self.scheduler.decide_batch(name, fs.spec.slo_ttft_s, n, oldest_wait, self.now)
            if decision.dispatch or decision.recheck_at_s <= self.now + 1e-9:  # expired up to rounding
                return max(1, min(n, decision.size))
            recheck = decision.recheck_at_s
        self.recheck(name, fs, recheck)
        return 0

    def dispatch(self, name: FunctionName) -> None:
        """Release what `name`'s queue can send now (the agent's dispatcher)."""
        self._pump(name)

    def _pump(self, name: FunctionName) -> None:
        fs = self.fns[name]
        fs.blocked = False
        self.blocked.pop(name, None)
        while fs.queue:
            if self.now < fs.dispatch_free_at_s - 1e-9:  # the dispatcher is still awaiting a cold start
                self.recheck(name, fs, fs.dispatch_free_at_s)
                return
            size = self._batch_size(name, fs)
            if size == 0:
                return
            if self.policy.agent_admission:  # lorafaas and its ablations: the agent's admission policy
                if not self.admission.admit(name, fs, size):
                    return
                continue
            instance = self._free_instance(name, fs) or self.lifecycle.start_baseline_instance(name, fs, size)
            if instance is None:  # no device can take it now (or the function is at its maximum): wait
                fs.blocked = True
                self.blocked[name] = None
                return
            size = min(size, self._room(name, fs, instance))
            batch = [fs.queue.popleft() for _ in range(size)]
            self.run_batch(instance, batch)

    def _room(self, name: FunctionName, fs: FunctionState, inst: SimInstance) -> int:
        """Requests a baseline's `inst` may take now: `concurrency` batches of any size (their continuous
        batching; the batching already sized the batch)."""
        return len(fs.queue) if inst.running < self.concurrency else 0

    def _free_instance(self, name: FunctionName, fs: FunctionState) -> SimInstance | None:
        with_room = [inst for inst in fs.instances if self._room(name, fs, inst) > 0]
        return min(with_room, key=lambda inst: (inst.num_seqs, inst.ready_at_s), default=None)

    # -- batches ------------------------------------------------------------------------------------------------

    def run_batch(self, inst: SimInstance, batch: list[int]) -> None:
        """Send `batch` to `inst`'s worker: it holds the requests' memory from now and prefills them in its next
        pass (`WorkerModel.schedule_pass`)."""
        fs = self.fns[inst.function]
        backbone = self.costs.backbone(fs.spec)
        device = inst.device
        reqs = [self.workload.requests[i] for i in batch]
        inst.num_seqs += len(reqs)
        kv = self.costs.kv_bytes(backbone, sum(r.prompt_tokens + r.output_tokens for r in reqs))
        self.mem.bill(device, self.now)
        starts_running = inst.running == 0
        if starts_running:  # contention is between processes: an instance's batches share its forward passes
            device.num_running += 1
            self.lifecycle.note_busy(device)
        inst.running += 1
        inst.expire_token += 1
        device.used_bytes += kv
        running = self.mem.running_functions[device.device_id]
        if running.get(inst.function, 0) == 0:
            device.active_overhead += inst.overhead_bytes
        running[inst.function] = running.get(inst.function, 0) + 1
        device.active_overhead += kv
        self.mem.bill(device, self.now)
        group = [len(batch)]
        for i in batch:
            self.results[i].sent_s = self.now
            inst.waiting.append((i, group))
        self.worker.schedule_pass(inst)
        if starts_running:  # the device's load moved: its decoding instances go on at the new rate
            self.worker.retime(device)

    def _on_done(self, event: Done) -> None:
        inst = event.instance
        finished = self.worker.on_done(event)
        for row in finished:
            self._release(inst, row.kv_bytes, row.batch)
        if not finished:
            return
        self.worker.retime(inst.device)
        fs = self.fns[inst.function]
        if fs.queue:
            self._pump(inst.function)
        if inst.running == 0 and not inst.permanent:
            if not any(i.running for i in fs.instances):
                fs.last_end_s = self.now
                # idle as a whole: its instances retire one per step (KeepAlivePolicy), as the agent's do
                at_s = None if fs.queue else self.scheduler.next_idle_retirement_s(inst.function, self.now, None)
                if at_s is not None:
                    self.push(at_s, IdleRetire(inst.function, self.now))
            self.push(self.now + self.keep_alive_s(inst.function), Expire(inst, inst.expire_token))
            self.lifecycle.keep_within_budget(inst.device.node)
        self.retry_blocked()

    def keep_alive_s(self, name: FunctionName) -> float:
        decision = self.scheduler.keep_alive(name)
        return decision.prewarm_s + decision.keep_alive_s if self.policy.keep_alive == "hybrid" \
            else self.cluster.keep_alive_s

    def _release(self, inst: SimInstance, kv: int, batch: list[int]) -> None:
        """A request is over: its memory and slot are free; the last of its batch ends the batch."""
        device = inst.device
        self.mem.bill(device, self.now)
        inst.num_seqs -= 1
        inst.last_used_s = self.now
        device.used_bytes -= kv
        device.active_overhead -= kv
        batch[0] -= 1
        if batch[0] == 0:  # the last request of its batch
            inst.running -= 1
            if inst.running == 0:
                device.num_running -= 1
            running = self.mem.running_functions[device.device_id]
            running[inst.function] -= 1
            if running[inst.function] == 0:
                del running[inst.function]
                device.active_overhead -= inst.overhead_bytes
        self.mem.bill(device, self.now)

    def retry_blocked(self) -> None:
        """Waiting functions in the order they blocked; stop at the first that still cannot start (memory freed by
        one event rarely serves more than the head of the line, and retrying everyone is O(blocked) views). Under
        strict compute every one looks, those waiting for a core first: a freed core goes to the longest waiting, and
        the running instances that yielded to it may take requests again once nobody waits."""
        if self.admission.strict:
            waiting = self.admission.turns.waiting(self.now)
            for name in [*waiting, *(n for n in self.blocked if n not in waiting)]:
                if name in self.blocked:
                    self._pump(FunctionName(name))
            return
        for name in list(self.blocked):
            if name in self.blocked:
                self._pump(name)
                if name in self.blocked:
                    return

    def _on_plan(self, tick: bool) -> None:
        """`tick`: the periodic plan (schedules the next); else a re-plan because a rate moved."""
        self.num_plans += 1
        self.last_plan_s = self.now
        view = self.views.view()
        started = time.perf_counter()  # the scheduler's decision time, reported, never simulated
        plan = self.scheduler.plan(view, self.now)
        self.plan_times_s.append(time.perf_counter() - started)
        self.views.apply_plan(plan)
        if tick:
            for node in range(self.cluster.num_nodes):
                self.lifecycle.keep_within_budget(node)
            self.push(self.now + self.cluster.plan_interval_s, PlanTick())

    # -- instances (lifecycle.py; the admission and the views call these) ---------------------------------------

    def busy(self, device: DeviceState) -> int:
        return self.lifecycle.busy(device)

    def start_on(self, name: FunctionName, fs: FunctionState, device: DeviceState, batch_size: int
                 ) -> SimInstance | None:
        return self.lifecycle.start_on(name, fs, device, batch_size)

    def stop_instance(self, inst: SimInstance, keep_artifacts: bool) -> None:
        self.lifecycle.stop_instance(inst, keep_artifacts)
