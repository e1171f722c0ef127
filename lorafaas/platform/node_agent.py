"""The node agent: function instances on this machine, from cold start to scale-to-zero.

It owns the instance table (all mutations happen on the event loop, between awaits, so no locks), and for each
function: routes requests to the least-loaded ready instance, starts a new one (a cold start from the library pool)
when all are busy and the function may grow, keeps `min_instances` ready, retires instances idle past their
keep-alive, restarts crashed ones, and on redeploy starts the new version before draining the old (atomic switch).

Instances are started by a `Backend` (local processes or Kubernetes pods); every call to a worker goes through its
`WorkerClient`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec

from lorafaas.errors import InstanceUnavailable, LorafaasError
from lorafaas.function_runtime import messages as m
from lorafaas.function_runtime.client import WorkerClient
from lorafaas.function_runtime.lora_servers import LoraServers, with_lora_mode
from lorafaas.function_runtime.zygote import prepare_backbone, zygote_status
from lorafaas.platform.admission import Admission
from lorafaas.platform.agent_scheduler import AgentScheduler
from lorafaas.platform.backends.base import Backend, InstanceRef
from lorafaas.platform.state.records import FunctionSpec
from lorafaas.scheduler import Scheduler, SchedulerConfig, in_flight_limit, may_scale_out, start_beats_joining

log = logging.getLogger(__name__)
MAX_FAILURES_KEPT = 20  # per function, for describe

InstanceState = Literal["starting", "ready", "draining", "stopped", "crashed"]
REQUEST_STAGES: tuple[m.StageName, ...] = ("libraries", "backbone", "adapter")


@dataclass(frozen=True)
class AgentConfig:
    device: str = "cpu"
    max_batch_size: int = 8  # per instance: the worker's batch capacity
    device_budget_bytes: int = 8 * 1024**3
    scheduler: SchedulerConfig = field(default_factory=lambda: SchedulerConfig(max_batch_size=8))
    num_threads: int = 1
    compute_slots: int | None = None  # instances that run at full speed at once; None: cores / num_threads on a CPU
    reconcile_interval_s: float = 0.5
    plan_interval_s: float = 5.0
    fill_or_expire: bool = False  # hold requests to fill a batch (for workers without continuous batching)
    stop_timeout_s: float = 10.0


@dataclass
class Instance:
    instance_id: str
    function: str
    version: int
    device: str
    state: InstanceState = "starting"
    handle: InstanceRef | None = None
    client: WorkerClient | None = None
    in_flight: int = 0
    started_at: float = field(default_factory=time.time)
    last_used_s: float = 0.0  # agent clock
    cold_start: dict[str, float] = field(default_factory=dict)  # seconds per step of the start that made it
    loaded: set[str] = field(default_factory=set)  # artifact kinds loaded in it
    adapter: dict | None = None  # the adapter it loaded at start (kind, LoRA mode, bytes held): AdapterStats
    ready_event: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def pid(self) -> int | None:
        return self.handle.pid if self.handle else None

    def describe(self) -> dict:
        return {"instance_id": self.instance_id, "pid": self.pid, "device": self.device, "state": self.state,
                "version": self.version, "in_flight": self.in_flight, "started_at": self.started_at,
                "loaded": sorted(self.loaded), "cold_start": dict(self.cold_start), "adapter": self.adapter}


class NodeAgent:
    def __init__(
        self,
        launcher: Backend,
        adapter_path: Callable[[str], Path],
        config: AgentConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        lora_servers: LoraServers | None = None,  # the MoE backbones' LoRA servers here; None: the backend runs none
    ) -> None:
        self.launcher = launcher
        self.lora_servers = lora_servers
        self.adapter_path = adapter_path
        self.config = config or AgentConfig()
        self.clock = clock
        self.specs: dict[str, FunctionSpec] = {}
        self.instances: dict[str, list[Instance]] = {}
        self.last_cold_start: dict[str, dict[str, float]] = {}
        self.last_scale_out_s: dict[str, float] = {}  # a start beside a running instance: what the next one expects
        self.num_cold_starts: dict[tuple[str, str], int] = {}  # (function, kind) -> count
        self.num_restarts: dict[str, int] = {}
        self.most_in_flight: dict[str, int] = {}  # function -> most requests one instance has held at once
        self.crashes: dict[str, list[dict]] = {}  # function -> its instances that exited unexpectedly (recent last)
        self._tasks: set[asyncio.Task] = set()
        self._reconciler: asyncio.Task | None = None
        self._random = random.Random(0)
        self.scheduler = Scheduler(self.config.scheduler, random.Random(0))
        self.admission = Admission(self.scheduler, self.clock, self._acquire, self.config.fill_or_expire)
        self.policy = AgentScheduler(self)
        self.in_flight_tokens: dict[str, int] = {}  # estimated tokens of the requests running, per function
        self.library_import_s: float | None = None
        self._last_plan_s = -1e9
        self._last_end: dict[str, float] = {}  # when each function last became idle (agent clock)

    # -- lifecycle -------------------------------------------------------------------------------------------------

    async def start(self) -> None:
        await asyncio.to_thread(self.launcher.start_zygote)
        if self.launcher.zygote_pid is not None:  # a backend without a library pool (pods) has nothing to ask
            status = await asyncio.to_thread(zygote_status, self.launcher.zygote_socket)
            self.library_import_s = status.import_s
        self._reconciler = asyncio.create_task(self._reconcile_forever())

    async def stop(self) -> None:
        if self._reconciler:
            self._reconciler.cancel()
        for task in list(self._tasks):
            task.cancel()
        for instances in self.instances.values():
            for instance in list(instances):
                await self.stop_instance(instance)
        await asyncio.to_thread(self.launcher.close)
        if self.lora_servers is not None:
            await asyncio.to_thread(self.lora_servers.close)

    def apply(self, spec: FunctionSpec) -> None:
        """Adopt a (new version of a) function spec; the reconciler starts, drains and retires instances."""
        if self.config.scheduler.preloading and not any(s.backbone == spec.backbone for s in self.specs.values()):
            self._spawn(self.prepare_backbone(spec.backbone))
        previous = self.specs.get(spec.name)
        self.specs[spec.name] = spec
        self.instances.setdefault(spec.name, [])
        if previous is not None and previous.version != spec.version:
            self._spawn(self._roll(spec))
        self._spawn(self._reconcile(spec.name))

    async def prepare_backbone(self, backbone: str) -> None:
        """Make the backbone resident: its daemon running and its tokenizer in the library pool, so that cold starts
        find it loaded (a pre-load; with pre-loading on, the first function on a backbone does it too)."""
        if backbone not in self.launcher.running_backbones():
            started = time.perf_counter()
            await asyncio.to_thread(self.launcher.daemon_socket, backbone)
            self.policy.record_daemon_start(backbone, time.perf_counter() - started)
        if self.launcher.zygote_pid is not None:
            await asyncio.to_thread(prepare_backbone, self.launcher.zygote_socket, self.launcher.store.path(backbone))

    async def remove(self, name: str) -> None:
        spec = self.specs.pop(name, None)
        self.scheduler.forget(name)
        for instance in self.instances.pop(name, []):
            await self.stop_instance(instance)
        if spec is not None and self.lora_servers is not None and all(
                s.backbone != spec.backbone for s in self.specs.values()):  # the backbone's last function went
            await asyncio.to_thread(self.lora_servers.stop, spec.backbone)

    # -- invocation ------------------------------------------------------------------------------------------------

    async def invoke(self, spec: FunctionSpec, request: m.Generate) -> AsyncIterator[m.Token | m.Finished]:
        """Stream one request's events. It waits in the function's queue until the batch policy dispatches it; a
        request that fails before its first token is retried once elsewhere."""
        self._observe_arrival(spec.name)
        for attempt in (1, 2):
            admitted = await self.admission.admit(spec)
            instance, dispatched = admitted.instance, self.clock()
            self.most_in_flight[spec.name] = max(self.most_in_flight.get(spec.name, 0), instance.in_flight)
            produced = False
            tokens = self.policy.request_tokens(request)
            if self.config.scheduler.offloading:
                try:
                    await self.policy.make_room(spec, tokens)
                except BaseException:
                    self._release(spec.name, instance)
                    raise
            self.in_flight_tokens[spec.name] = self.in_flight_tokens.get(spec.name, 0) + tokens
            try:
                async for event in instance.client.generate(request):
                    if not produced:
                        produced = True
                        instance.loaded.update(REQUEST_STAGES)  # the worker reloads whatever was offloaded
                        self._observe_prefill(spec, admitted.batch_size, event, self.clock() - dispatched)
                    yield event
                return
            except InstanceUnavailable:
                if produced or attempt == 2:
                    raise
                log.warning("%s: instance %s failed before the first token; retrying", spec.name,
                            instance.instance_id)
            finally:
                self.in_flight_tokens[spec.name] = max(0, self.in_flight_tokens.get(spec.name, 0) - tokens)
                self._release(spec.name, instance)

    def _release(self, name: str, instance: Instance) -> None:
        """A request admitted to `instance` is over."""
        instance.in_flight -= 1
        instance.last_used_s = self.clock()
        self._observe_end(name)
        self.admission.wake(name)

    def _observe_prefill(self, spec: FunctionSpec, batch_size: int, first: m.Token | m.Finished,
                         waited_s: float) -> None:
        """T(b) for the batching model: the worker prefills the requests waiting for it together and reports, on a
        request's first token, the forward time and how many the pass held (queueing excluded). An event without
        them (a request that ended before any token) counts as its dispatch batch taking the time it waited."""
        prefill_s = getattr(first, "prefill_s", None)
        together = getattr(first, "prefill_batch", None)
        if prefill_s is not None and together:
            self.scheduler.observe_prefill(spec.name, spec.slo_ttft_ms / 1e3, together, prefill_s)
        else:
            self.scheduler.observe_prefill(spec.name, spec.slo_ttft_ms / 1e3, batch_size, waited_s)

    def _observe_arrival(self, name: str) -> None:
        now = self.clock()
        self.scheduler.observe_arrival(name, now)
        if name in self._last_end and not self._in_flight(name):  # an idle period ends: keep-alive histogram
            self.scheduler.observe_idle(name, now - self._last_end[name])

    def _observe_end(self, name: str) -> None:
        if not self._in_flight(name):
            self._last_end[name] = self.clock()

    def _in_flight(self, name: str) -> int:
        return sum(i.in_flight for i in self.instances.get(name, []))

    async def _acquire(self, spec: FunctionSpec, cap: int) -> Instance | None:
        """An instance of the current version with fewer than `cap` requests in flight, starting one (a cold start)
        if the function may grow, else one with room in its worker's batch (`in_flight_limit`); None when all are
        full. A start expected to outlast the SLO (the function's last scale-out did) gives way to a running batch
        with room (`start_beats_joining`)."""
        pool = self.instances.setdefault(spec.name, [])
        # A ready instance whose connection dropped died a moment ago (its watcher has not run yet): not a choice.
        current = [i for i in pool if i.version == spec.version and i.state in ("starting", "ready")
                   and (i.state == "starting" or i.client.connected)]
        free = [i for i in current if i.state == "ready" and i.in_flight < min(cap, self.config.max_batch_size)]
        if free:
            return self._least_loaded(free)
        limit = in_flight_limit(cap, self.config.max_batch_size, False, self.config.scheduler.adaptive_batching)
        joinable = [i for i in current if i.state == "ready" and i.in_flight < min(limit, self.config.max_batch_size)]
        if (len(current) < spec.max_instances
                and may_scale_out(len(current), self._busy_instances(), self.compute_slots)
                and (not joinable or start_beats_joining(self.last_scale_out_s.get(spec.name),
                                                         spec.slo_ttft_ms / 1e3))):
            return await self._start_instance(spec, stages=REQUEST_STAGES, kind="libraries_preloaded")
        if joinable:
            return self._least_loaded(joinable)
        starting = [i for i in current if i.state == "starting"]
        if starting:
            await starting[0].ready_event.wait()
            if starting[0].state == "ready" and starting[0].in_flight < cap:
                return starting[0]
        return None

    def _busy_instances(self) -> int:
        return sum(1 for pool in self.instances.values() for i in pool if i.in_flight or i.state == "starting")

    @property
    def compute_slots(self) -> int:
        if self.config.compute_slots is not None:
            return self.config.compute_slots
        if self.config.device == "cpu":
            return max(1, (os.cpu_count() or 1) // max(1, self.config.num_threads))
        return 1  # a GPU runs one instance's kernels at a time; batching, not more instances, fills it

    def _least_loaded(self, instances: list[Instance]) -> Instance:
        lowest = min(i.in_flight for i in instances)
        return self._random.choice([i for i in instances if i.in_flight == lowest])

    # -- instances -------------------------------------------------------------------------------------------------

    async def _start_instance(self, spec: FunctionSpec, stages: tuple[m.StageName, ...], kind: str) -> Instance:
        instance = Instance("(starting)", spec.name, spec.version, self.config.device)
        scale_out = any(i.state == "ready" for i in self.instances.get(spec.name, []))
        self.instances.setdefault(spec.name, []).append(instance)  # counted at once, so bursts respect max
        started = time.perf_counter()
        try:
            worker_spec = await asyncio.to_thread(  # may start the backbone daemon: off the event loop
                self.launcher.spec, spec.name, spec.backbone, self.adapter_path(spec.adapter_digest),
                max_batch_size=self.config.max_batch_size, num_threads=self.config.num_threads, deployment=spec.uid,
            )
            worker_spec = await asyncio.to_thread(  # an expert adapter's mode; may start the LoRA server
                with_lora_mode, worker_spec, spec.backbone, spec.lora_mode, self.lora_servers)
            instance.instance_id = worker_spec.instance_id
            instance.handle = await asyncio.to_thread(self.launcher.launch, worker_spec)
            instance.cold_start["spawn"] = time.perf_counter() - started
            instance.client = await instance.handle.connect()
            for stage in stages:
                done = await instance.client.stage(stage)
                instance.cold_start[stage] = done.seconds
                instance.loaded.add(stage)
                if stage == "adapter" and done.adapter is not None:
                    instance.adapter = msgspec.to_builtins(done.adapter)
        except (LorafaasError, OSError) as exc:
            instance.state = "crashed"
            instance.ready_event.set()
            self.instances[spec.name].remove(instance)
            if instance.handle:
                await asyncio.to_thread(instance.handle.kill)
            raise InstanceUnavailable(f"function {spec.name}: starting an instance failed: {exc}") from exc
        instance.cold_start["total"] = time.perf_counter() - started
        instance.state = "ready"
        instance.last_used_s = self.clock()
        instance.ready_event.set()
        self.last_cold_start[spec.name] = dict(instance.cold_start)
        if scale_out:  # a first start may also start the backbone's daemon; a scale-out binds to it
            self.last_scale_out_s[spec.name] = instance.cold_start["total"]
        self.policy.record_cold_start(spec, instance.cold_start)
        self.num_cold_starts[spec.name, kind] = self.num_cold_starts.get((spec.name, kind), 0) + 1
        self._spawn(self._watch(instance))
        log.info("%s: instance %s (pid %s) ready in %.0f ms (%s)", spec.name, instance.instance_id, instance.pid,
                 instance.cold_start["total"] * 1e3, kind)
        return instance

    async def _watch(self, instance: Instance) -> None:
        await instance.client.wait_closed()
        if instance.state in ("ready", "starting"):
            instance.state = "crashed"
            self.num_restarts[instance.function] = self.num_restarts.get(instance.function, 0) + 1
            log.warning("%s: instance %s (pid %s) exited unexpectedly", instance.function, instance.instance_id,
                        instance.pid)
            crashes = self.crashes.setdefault(instance.function, [])
            crashes.append({"instance_id": instance.instance_id, "pid": instance.pid, "reason": "exited unexpectedly",
                            "at": time.time()})
            del crashes[:-MAX_FAILURES_KEPT]
            pool = self.instances.get(instance.function, [])
            if instance in pool:
                pool.remove(instance)
            if instance.handle:
                await asyncio.to_thread(instance.handle.kill)
            if instance.function in self.specs:
                self._spawn(self._reconcile(instance.function))

    async def stop_instance(self, instance: Instance) -> None:
        if instance.state in ("stopped", "crashed"):
            return
        instance.state = "stopped"
        pool = self.instances.get(instance.function, [])
        if instance in pool:
            pool.remove(instance)
        if instance.client is not None:
            with contextlib.suppress(LorafaasError, OSError):
                await instance.client.shutdown()
            await instance.client.close()
        if instance.handle is not None:
            await asyncio.to_thread(instance.handle.kill, 15, self.config.stop_timeout_s)
            with contextlib.suppress(ValueError):
                self.launcher.instances.remove(instance.handle)
        log.info("%s: instance %s stopped", instance.function, instance.instance_id)

    # -- reconciliation --------------------------------------------------------------------------------------------

    async def _reconcile_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.reconcile_interval_s)
            for name in list(self.specs):
                try:
                    await self._reconcile(name)
                except LorafaasError as exc:
                    log.warning("%s: reconcile failed: %s", name, exc.message)
            try:
                await self._plan_artifacts()
            except LorafaasError as exc:
                log.warning("pre-load plan failed: %s", exc.message)

    async def _plan_artifacts(self) -> None:
        """Pre-loading on: apply the knapsack's plan when rates moved (or every plan_interval_s). Off: nothing is
        kept ahead of requests, so a backbone no instance uses is unloaded."""
        now = self.clock()
        if self.config.scheduler.preloading:
            if self.scheduler.should_replan(now) or now - self._last_plan_s >= self.config.plan_interval_s:
                self._last_plan_s = now
                await self.policy.apply_plan(now)
            return
        in_use = {self.specs[n].backbone for n, pool in self.instances.items() if pool and n in self.specs}
        for backbone in self.launcher.running_backbones():
            if backbone not in in_use:
                await asyncio.to_thread(self.launcher.stop_daemon, backbone)

    async def _reconcile(self, name: str) -> None:
        """min_instances ready (pre-warmed, all artifacts); idle instances past keep-alive retired."""
        spec = self.specs.get(name)
        if spec is None:
            return
        pool = self.instances.setdefault(name, [])
        current = [i for i in pool if i.version == spec.version and i.state in ("starting", "ready")]
        for _ in range(spec.min_instances - len(current)):
            await self._start_instance(spec, stages=m.STAGES, kind="prewarm")
        now, keep_alive_s = self.clock(), self.keep_alive_s(spec)
        idle = sorted((i for i in current if i.state == "ready" and i.in_flight == 0
                       and now - i.last_used_s >= keep_alive_s), key=lambda i: i.last_used_s)
        for instance in idle[: max(0, len(current) - spec.min_instances)]:
            log.info("%s: instance %s idle for %.1f s (keep-alive %.1f s): retiring", name, instance.instance_id,
                     now - instance.last_used_s, keep_alive_s)
            await self.stop_instance(instance)

    def keep_alive_s(self, spec: FunctionSpec) -> float:
        """The function's own keep-alive, unless the hybrid policy has a representative idle-time histogram."""
        if self.config.scheduler.keep_alive_policy == "hybrid":
            decision = self.scheduler.keep_alive(spec.name)
            if decision.reason == "histogram":
                return decision.prewarm_s + decision.keep_alive_s
        return spec.keep_alive_s

    async def _roll(self, spec: FunctionSpec) -> None:
        """Redeploy: the new version's instance is ready before the old ones drain."""
        pool = self.instances.get(spec.name, [])
        old = [i for i in pool if i.version != spec.version]
        if any(i.state == "ready" for i in old):
            await self._start_instance(spec, stages=m.STAGES, kind="redeploy")
        for instance in old:
            instance.state = "draining"
        while any(i.in_flight for i in old):
            await asyncio.sleep(0.05)
        for instance in old:
            await self.stop_instance(instance)

    def _spawn(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)

    # -- views -------------------------------------------------------------------------------------------------------

    def describe(self, name: str) -> list[dict]:
        return [i.describe() for i in self.instances.get(name, [])]

    def offloaded(self, name: str) -> list[dict]:
        return self.policy.describe(name)

    def failures(self, name: str) -> list[dict]:
        """Instances of the function that failed: crashed processes seen here, and what the backend saw (a pod that
        could not be scheduled, pull its image or stay alive)."""
        from_backend = getattr(self.launcher, "describe_failures", None)  # only backends with a control plane
        return [*self.crashes.get(name, []), *(from_backend(name) if from_backend else [])]

    def batching(self, spec: FunctionSpec) -> dict:
        """The batching decision for the function now: B and the fitted prefill model T(b) = T0 + a(b-1) it comes from,
        and the most requests one instance has held at once."""
        policy = self.scheduler.batch_policy(spec.name, spec.slo_ttft_ms / 1e3)
        return {"max_batch_size": min(policy.max_batch_size, self.config.max_batch_size),
                "prefill_t0_s": round(policy.model.t0_s, 4), "prefill_per_request_s": round(policy.model.a_s, 4),
                "prefills_observed": policy.model.num_observed,
                "most_in_flight": self.most_in_flight.get(spec.name, 0)}

    def count_by_state(self) -> dict[tuple[str, str], int]:
        counts: dict[tuple[str, str], int] = {}
        for name, pool in self.instances.items():
            for instance in pool:
                counts[name, instance.state] = counts.get((name, instance.state), 0) + 1
        return counts


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        exc = task.exception()
        message = exc.message if isinstance(exc, LorafaasError) else repr(exc)
        log.warning("background task failed: %s", message)
