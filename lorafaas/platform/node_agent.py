"""The node agent: function instances on this machine, from cold start to scale-to-zero.

Instances live in one `InstanceTable` (explicit states, every transition in one place; see instance_table.py) and
serve exactly one identity: tenant, function, deployment uid, version and adapter. For each function the agent
routes queued requests as the scheduler's admission policy decides (`lorafaas.scheduler.admission`), keeps
`min_instances` ready, retires instances idle past their keep-alive, replaces crashed and hung ones, and on update
either relabels its instances (settings only) or starts the new adapter's instance before draining the old ones.
Deleting a function drains it: queued requests fail at once, nothing starts for it, its instances stop once the
requests they hold are done.

All mutations happen on the event loop, between awaits, so no locks. Instances are started by a `Backend` (local
processes or Kubernetes pods); every call to a worker goes through its `WorkerClient`. The agent drives the CPU or
one or more GPUs (`AgentConfig.devices`); where an instance starts is in devices.py.
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

import msgspec

from lorafaas.errors import FunctionNotFound, InstanceHung, InstanceUnavailable, LorafaasError
from lorafaas.function_runtime import messages as m
from lorafaas.function_runtime.client import tcp_address
from lorafaas.function_runtime.zygote import prepare_backbone, zygote_status
from lorafaas.platform.admission import Admission
from lorafaas.platform.agent_scheduler import AgentScheduler
from lorafaas.platform.backends.base import Backend
from lorafaas.platform.backends.lora_servers import LoraServers, with_lora_mode
from lorafaas.platform.compute_gate import ComputeGate
from lorafaas.platform.devices import Device, backbone_device, check_devices, start_options, start_order
from lorafaas.platform.instance_table import Identity, Instance, InstanceTable
from lorafaas.platform.metering import DeviceShareClock, UsageMeter
from lorafaas.platform.state.records import FunctionSpec
from lorafaas.protocols.daemon_config import base_pass_socket
from lorafaas.scheduler import (
    AdmissionDecision,
    AdmissionView,
    ComputeTurns,
    CoreGrants,
    InstanceLoad,
    Scheduler,
    SchedulerConfig,
    can_join,
    decide_admission,
    needs_start_options,
    worth_offering,
)

log = logging.getLogger(__name__)
MAX_FAILURES_KEPT = 20  # per function, for describe

# A step gate's grant lasts at most this long: a worker stuck in a step (until the hang detector kills it) stops
# holding other functions' steps back; a real step here takes well under a second (a padded prefill of 8 x 128 tokens:
# about 1.6 s on this 2-core machine)
GATE_LEASE_S = 5.0
# The shared base pass pays from this many members stepping at once per compute slot (docs/performance.md, "The
# shared base pass": three functions on two cores lost to each computing its own pass, eight gained)
SHARED_BASE_FROM_PER_SLOT = 3
REQUEST_STAGES: tuple[m.StageName, ...] = ("libraries", "backbone", "adapter")
WORKER_FIELDS = ("backbone", "adapter_digest", "lora_mode", "shared_base")  # what an instance was started with


# A worker's batch capacity by default. At 32 concurrent requests over three functions on two cores, 32 against 8
# gave 1.13x the tokens/s and a TTFT p90 of 1.75 s against 14.8 s: beyond its capacity a request waits for a whole
# generation to end (docs/performance.md, "Worker capacity").
DEFAULT_MAX_BATCH = 32


@dataclass(frozen=True)
class AgentConfig:
    # the CPU, or one or more GPUs, each with its memory budget; compute slots, busy counts and daemons are per device
    devices: tuple[Device, ...] = (Device("cpu", 8 * 1024**3),)
    max_batch_size: int = DEFAULT_MAX_BATCH  # per instance: the worker's batch capacity
    scheduler: SchedulerConfig = field(default_factory=lambda: SchedulerConfig(max_batch_size=DEFAULT_MAX_BATCH))
    num_threads: int = 1
    compute_slots: int | None = None  # per device, run at full speed at once; None: cores / num_threads on a CPU
    # never more busy instances than compute slots, functions taking turns (AdmissionView.strict_compute). Off by
    # default: measured on this 2-core machine it lost to time-slicing on both tokens/s and first-token latency
    # (docs/performance.md, "Strict compute against time-slicing")
    strict_compute: bool = False
    # local CPU workers ask the device's step gate before every engine step: never more of them compute at once than
    # compute slots, counted across functions; one computing alone gets up to `lone_threads` (None: every core)
    step_gate: bool = True
    lone_threads: int | None = None
    # local CPU workers join the daemon's shared base pass (docs/performance.md, "The shared base pass"). Under the
    # step gate a member's step goes to it, its backbone products batched with other functions' rows, only while
    # at least `shared_base_from` members step at once (None: SHARED_BASE_FROM_PER_SLOT x compute slots); below
    # that members compute their own pass on granted cores. Without the gate members always go to the pass.
    shared_base: bool = False
    shared_base_from: int | None = None
    reconcile_interval_s: float = 0.5
    plan_interval_s: float = 5.0
    fill_or_expire: bool = False  # hold requests to fill a batch (for workers without continuous batching)
    stop_timeout_s: float = 10.0
    # Liveness: an instance holding requests that sent nothing for `heartbeat_after_s` is asked for a heartbeat; no
    # answer within `hang_timeout_s`, or no engine step for `hang_after_steps_s`, and it is declared hung.
    heartbeat_after_s: float = 2.0
    hang_timeout_s: float = 10.0
    hang_after_steps_s: float = 120.0

    def __post_init__(self) -> None:
        check_devices(self.device_names)
        for name in ("heartbeat_after_s", "hang_timeout_s", "hang_after_steps_s", "reconcile_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} is {getattr(self, name)}; it must be > 0")

    @property
    def device_names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.devices)

    @property
    def cpu(self) -> bool:
        """The agent drives the CPU (else GPUs: `cpu` stands alone)."""
        return self.devices[0].name == "cpu"


def same_worker(a: FunctionSpec, b: FunctionSpec) -> bool:
    """Whether an instance started for `a` answers exactly as one started for `b` (a settings-only change)."""
    return a.uid == b.uid and all(getattr(a, f) == getattr(b, f) for f in WORKER_FIELDS)


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
        self.specs: dict[str, FunctionSpec] = {}  # the current spec of every function deployed here
        self.table = InstanceTable()
        self.last_cold_start: dict[str, dict[str, float]] = {}
        self.last_scale_out_s: dict[str, float] = {}  # a start beside a running instance: what the next one expects
        self.num_cold_starts: dict[tuple[str, str], int] = {}  # (function, kind) -> count
        self.num_restarts: dict[str, int] = {}
        self.most_in_flight: dict[str, int] = {}  # function -> most requests one instance has held at once
        self.crashes: dict[str, list[dict]] = {}  # function -> its instances that failed (recent last)
        self.num_failures: dict[tuple[str, str], int] = {}  # (function, crashed | hung | start_failed) -> count
        self.last_admission: dict[str, AdmissionDecision] = {}  # function -> the admission policy's last word
        self.waits: dict[str, dict[str, int]] = {}  # function -> reason -> times its queue looked and had to wait
        # the queues waiting for this device's compute; a queue that went away unannounced stops counting after 1 s
        # (a waiting dispatcher asks again every POLL_S)
        self.compute_turns = ComputeTurns(stale_after_s=1.0)
        self._tasks: set[asyncio.Task] = set()
        self._probes: dict[Instance, asyncio.Task] = {}
        self._reconciler: asyncio.Task | None = None
        self.idle_retired_s: dict[str, float] = {}  # function -> when its last stepped idle retirement happened
        self.gate: ComputeGate | None = None  # the device's step gate (local CPU workers); started by start()
        self.scheduler = Scheduler(self.config.scheduler, random.Random(0))
        self.admission = Admission(self.scheduler, self.clock, self._acquire, self.config.fill_or_expire)
        self.policy = AgentScheduler(self)
        self.in_flight_tokens: dict[str, int] = {}  # estimated tokens of the requests running, per function
        self.library_import_s: float | None = None
        self._last_plan_s = -1e9
        self._last_end: dict[str, float] = {}  # when each function last became idle (agent clock)
        self.device_share = DeviceShareClock(self.clock)  # what each request's share of the device is (metering)
        # Called with (instance, idle seconds, bytes) when an idle instance stops: its last keep-alive is charged.
        self.on_keep_alive: Callable[[Instance, float, float], None] | None = None

    # -- lifecycle -------------------------------------------------------------------------------------------------

    async def start(self) -> None:
        await asyncio.to_thread(self.launcher.start_zygote)
        if self.launcher.zygote_pid is not None:  # a backend without a library pool (pods) has nothing to ask
            status = await asyncio.to_thread(zygote_status, self.launcher.zygote_socket)
            self.library_import_s = status.import_s
            if self.config.step_gate and self.config.cpu:  # local workers, on this machine's cores
                threads = max(1, self.config.num_threads)
                shared_from = None
                if self.config.shared_base:
                    shared_from = self.config.shared_base_from or max(2, SHARED_BASE_FROM_PER_SLOT * self.compute_slots)
                self.gate = ComputeGate(self.launcher.zygote_socket.parent / "step-gate-cpu.sock",
                                        CoreGrants(self.compute_slots * threads, threads, self.config.lone_threads,
                                                   lease_s=GATE_LEASE_S, shared_from=shared_from),
                                        self._is_worker, self._is_base_pass_member)
                await self.gate.start()
        self._reconciler = asyncio.create_task(self._reconcile_forever())

    async def stop(self) -> None:
        if self._reconciler:
            self._reconciler.cancel()
        for task in [*self._tasks, *self._probes.values()]:
            task.cancel()
        for instance in self.table.all():
            await self.stop_instance(instance, "the node agent is stopping")
        await asyncio.to_thread(self.launcher.close)
        if self.gate is not None:
            await self.gate.stop()
        if self.lora_servers is not None:
            await asyncio.to_thread(self.lora_servers.close)

    def apply(self, spec: FunctionSpec) -> None:
        """Adopt a function's spec: a new function, or a new version of one. A settings-only version keeps its
        instances (they answer alike); a new adapter or LoRA mode rolls (the new version's instance is ready before
        the old ones drain). The reconciler starts, drains and retires instances."""
        if self.config.scheduler.preloading and not any(s.backbone == spec.backbone for s in self.specs.values()):
            self._spawn(self.prepare_backbone(spec.backbone))
        previous = self.specs.get(spec.name)
        self.specs[spec.name] = spec
        if previous is not None and previous.uid != spec.uid:  # a new deployment under the name: the old one goes
            self._drain_deployment(previous, f"function {spec.name} was deployed again")
        elif previous is not None and previous.version != spec.version:
            if same_worker(previous, spec):
                moved = self.table.relabel(Identity.of(previous), Identity.of(spec))
                log.info("%s: version %d changes settings only: %d instance(s) serve it as they are", spec.name,
                         spec.version, moved)
                self.admission.wake(spec.name)
            else:
                self._spawn(self._roll(previous, spec))
        self._spawn(self._reconcile(spec.name))

    async def prepare_backbone(self, backbone: str, device: str | None = None) -> None:
        """Make the backbone resident on `device` (None: where it runs already, else the device serving fewest
        backbones): its daemon running and its tokenizer in the library pool, so that cold starts find it loaded (a
        pre-load; with pre-loading on, the first function on a backbone does it too)."""
        device = device or backbone_device(self.config.device_names, self.launcher.running_backbones, backbone)
        if backbone not in self.launcher.running_backbones(device):
            started = time.perf_counter()
            await asyncio.to_thread(self.launcher.daemon_socket, backbone, device)
            self.policy.record_daemon_start(backbone, time.perf_counter() - started)
        if self.launcher.zygote_pid is not None:
            await asyncio.to_thread(prepare_backbone, self.launcher.zygote_socket, self.launcher.store.path(backbone))

    async def remove(self, name: str) -> None:
        """Delete a function: its queued requests fail at once, nothing new starts or is dispatched for it, and its
        instances stop once the requests they hold are done."""
        spec = self.specs.pop(name, None)
        if spec is None:
            return
        self.scheduler.forget(name)
        self.last_admission.pop(name, None)  # a redeploy under the name (maybe another tenant's) starts afresh
        self.waits.pop(name, None)
        self.idle_retired_s.pop(name, None)
        self.compute_turns.leave(Identity.of(spec))
        self._drain_deployment(spec, f"function {name} was deleted")
        if self.lora_servers is not None and all(s.backbone != spec.backbone for s in self.specs.values()):
            await asyncio.to_thread(self.lora_servers.stop, spec.backbone)  # the backbone's last function went

    def _drain_deployment(self, spec: FunctionSpec, reason: str) -> None:
        failed = self.admission.fail(lambda identity: identity.function == spec.name and identity.uid == spec.uid,
                                     FunctionNotFound(f"{reason} while this request waited"))
        if failed:
            log.info("%s: %d queued request(s) failed: %s", spec.name, failed, reason)
        for instance in self.table.of_function(spec.name):
            if instance.identity.uid == spec.uid:
                self._drain(instance, reason)

    def _drain(self, instance: Instance, reason: str) -> None:
        if instance.state in ("starting", "ready"):
            self.table.transition(instance, "draining", reason)
        self._finish_drain(instance)

    def _finish_drain(self, instance: Instance) -> None:
        """A draining instance stops once it holds no request and none is queued for its identity."""
        if (instance.state == "draining" and instance.staged and not instance.in_flight
                and not self.admission.queue_length(instance.identity)):
            self._spawn(self.stop_instance(instance, "drained"))

    # -- invocation ------------------------------------------------------------------------------------------------

    async def invoke(self, spec: FunctionSpec, request: m.Generate, meter: UsageMeter | None = None
                     ) -> AsyncIterator[m.Token | m.Finished]:
        """Stream one request's events. It waits in its identity's queue until the admission policy dispatches it;
        a request that fails before its first token is retried once elsewhere (never on another identity).
        `meter`, when given, is complete when `Finished` is yielded: times, cold start and charges (metering.py)."""
        self._observe_arrival(spec.name)
        meter = meter or UsageMeter()
        meter.arrived_s = self.clock()
        for attempt in (1, 2):
            admitted = await self.admission.admit(spec)
            instance, dispatched = admitted.instance, self.clock()
            instance.last_progress_s = dispatched
            self.most_in_flight[spec.name] = max(self.most_in_flight.get(spec.name, 0), instance.in_flight)
            self.table.record_busy(instance.device)
            produced = False
            tokens = self.policy.request_tokens(request)
            if self.config.scheduler.offloading:
                try:
                    await self.policy.make_room(spec, tokens, instance.device)
                except BaseException:
                    self._release(instance)
                    raise
            self.in_flight_tokens[spec.name] = self.in_flight_tokens.get(spec.name, 0) + tokens
            self._meter_dispatch(meter, instance, dispatched)
            share_mark: float | None = self.device_share.enter()
            try:
                async for event in instance.client.generate(request):
                    instance.last_progress_s = self.clock()
                    if not produced:
                        produced = True
                        meter.first_event_s = instance.last_progress_s
                        instance.loaded.update(REQUEST_STAGES)  # the worker reloads whatever was offloaded
                        self._observe_prefill(spec, admitted.batch_size, event, self.clock() - dispatched)
                    if isinstance(event, m.Token):
                        meter.completion_tokens += 1
                        if event.prompt_tokens is not None:
                            meter.prompt_tokens = event.prompt_tokens
                    if isinstance(event, m.Finished):  # charged now: the caller may never pull past it
                        meter.prompt_tokens, meter.completion_tokens = event.prompt_tokens, event.completion_tokens
                        meter.finished_s = instance.last_progress_s
                        meter.device_s += self.device_share.leave(share_mark)
                        share_mark = None
                    yield event
                return
            except InstanceUnavailable as exc:
                failure = exc
                if instance.hung:
                    failure = InstanceHung(f"function {spec.name}: instance {instance.instance_id} {instance.hung}; "
                                           "it was killed and is replaced")
                if produced or attempt == 2:
                    raise failure from exc
                log.warning("%s: instance %s failed before the first token (%s); retrying", spec.name,
                            instance.instance_id, failure.message)
            finally:
                if share_mark is not None:  # it failed or was abandoned: its device time still counts (a retry's)
                    meter.device_s += self.device_share.leave(share_mark)
                    if produced:
                        meter.finished_s = self.clock()
                self.in_flight_tokens[spec.name] = max(0, self.in_flight_tokens.get(spec.name, 0) - tokens)
                self._release(instance)

    def _meter_dispatch(self, meter: UsageMeter, instance: Instance, dispatched_s: float) -> None:
        """What a request dispatched to `instance` is charged besides its device share (see metering.py)."""
        meter.dispatched_s, meter.instance_id = dispatched_s, instance.instance_id
        if instance.ready_s >= meter.arrived_s:  # it became ready after the request arrived: the request waited
            meter.cold_start, meter.cold_start_s = instance.start_kind, dict(instance.cold_start)
        meter.active_bytes = instance.backbone_bytes + _adapter_bytes(instance)
        if instance.in_flight == 1:  # it was idle until this request: the keep-alive since is charged to it
            meter.keep_alive_s += self._idle_s(instance, dispatched_s)
            meter.idle_bytes = self._idle_bytes(instance)

    def _idle_s(self, instance: Instance, now_s: float) -> float:
        return max(0.0, now_s - max(instance.last_used_s, instance.ready_s))

    def _idle_bytes(self, instance: Instance) -> float:
        """What an idle instance keeps loaded for its function: its adapter and its share of the backbone copy
        (divided among the instances bound to it)."""
        bound = sum(1 for i in self.table.all() if i.backbone == instance.backbone and i.device == instance.device
                    and i.state in ("ready", "draining", "hung"))
        return _adapter_bytes(instance) + instance.backbone_bytes / max(1, bound)

    def _release(self, instance: Instance) -> None:
        """A request admitted to `instance` is over."""
        instance.in_flight -= 1
        instance.last_used_s = self.clock()
        self._observe_end(instance.function)
        self.admission.wake(instance.function)
        if instance.in_flight == 0:  # a compute slot may be free: the longest waiting queue looks at once
            for waiting in self.compute_turns.waiting(instance.last_used_s)[:1]:
                self.admission.wake(waiting.function)
        if instance.state == "draining":
            self._finish_drain(instance)

    def _observe_prefill(self, spec: FunctionSpec, batch_size: int, first: m.Token | m.Finished,
                         waited_s: float) -> None:
        """T(b) for the batching model: the worker prefills the requests waiting for it together and reports, on a
        request's first token, the forward time and how many the pass held (queueing excluded). An event without
        them (a request that ended before any token) counts as its dispatch batch taking the time it waited. A
        prefill run in the shared base pass is not observed: its time is the round's, with other functions' rows."""
        prefill_s = getattr(first, "prefill_s", None)
        together = getattr(first, "prefill_batch", None)
        if getattr(first, "prefill_shared", False):  # the round's time (other functions' rows), not T(b) of its own
            return
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
        return sum(i.in_flight for i in self.table.of_function(name))

    # -- admission -------------------------------------------------------------------------------------------------

    def serving_spec(self, spec: FunctionSpec) -> FunctionSpec:
        """The spec whose instances may answer a request accepted with `spec`: the current one when it answers
        alike, else `spec` itself (an older adapter: only its draining instances). FunctionNotFound when the
        deployment is gone."""
        current = self.specs.get(spec.name)
        if current is None or current.uid != spec.uid:
            raise FunctionNotFound(f"function {spec.name} was deleted while this request waited")
        if current.version == spec.version or same_worker(current, spec):
            return current
        return spec

    def admission_view(self, spec: FunctionSpec, queue_length: int) -> AdmissionView:
        """The function as the admission policy sees it: the instances of exactly this spec's identity and, for
        the current spec only, the devices where one could start (each with its own busy count)."""
        identity = Identity.of(spec)
        instances = [i for i in self.table.of_identity(identity)
                     if i.state == "starting" or (i.serving and i.state in ("ready", "draining"))]
        busy = {d: self.table.busy_on_device(d) for d in self.config.device_names}
        now = self.clock()
        waiting_others, waiting_ahead = self.compute_turns.counts(identity, now)
        shared = {i.device for i in self.table.all()
                  if i.function != spec.name and i.state in ("starting", "ready", "draining")}
        loads = tuple(InstanceLoad(i.instance_id, i.state != "starting", i.in_flight, i.started_s,
                                   busy.get(i.device, 0) < self.compute_slots, i.device in shared) for i in instances)
        steady = self.scheduler.steady(spec.name)
        current = self.specs.get(spec.name) == spec
        max_instances = spec.max_instances if current else len(loads)  # nothing starts for a superseded version
        slo_s = spec.slo_ttft_ms / 1e3
        slo_batch = self.scheduler.batch_policy(spec.name, slo_s).max_batch_size
        adaptive = self.config.scheduler.adaptive_batching
        options = ()
        if (needs_start_options(loads, slo_batch, self.config.max_batch_size, steady)
                and any(worth_offering(len(loads), max_instances, n, self.compute_slots) for n in busy.values())):
            joinable = can_join(loads, slo_batch, self.config.max_batch_size, adaptive)
            options = start_options(self._start_order(spec), busy, self.compute_slots, len(loads), max_instances,
                                    self.last_scale_out_s.get(spec.name) if joinable else None)
        return AdmissionView(
            function=spec.name, queue_length=queue_length, slo_ttft_s=slo_s, slo_batch=slo_batch,
            worker_capacity=self.config.max_batch_size, adaptive=adaptive, max_instances=max_instances,
            instances=loads, start_options=options,
            requests_per_background_start=self.config.scheduler.requests_per_background_start,
            strict_compute=self.config.strict_compute, compute_waiting_others=waiting_others,
            compute_waiting_ahead=waiting_ahead, compute_waited_s=self.compute_turns.waited_s(identity, now),
            max_compute_wait_s=self.config.scheduler.max_compute_wait_s, steady=steady,
        )

    async def _acquire(self, spec: FunctionSpec, queue_length: int) -> tuple[Instance, int] | None:
        """Carry out the admission policy for `queue_length` requests accepted with `spec`: (an instance, how many
        it takes now), or None to wait. Raises FunctionNotFound for a deleted function, InstanceUnavailable for
        requests of a superseded adapter that no instance is left to serve, or a failed start."""
        serving = self.serving_spec(spec)
        view = self.admission_view(serving, queue_length)
        decision = decide_admission(view)
        self.last_admission[spec.name] = decision
        identity = Identity.of(serving)
        self.compute_turns.note(identity, decision, self.clock())
        if decision.action in ("wait", "await_start"):
            reasons = self.waits.setdefault(spec.name, {})
            reasons[decision.reason] = reasons.get(decision.reason, 0) + 1
        by_id = {i.instance_id: i for i in self.table.of_identity(identity)}
        if decision.action == "dispatch":
            if decision.device is not None:  # a slow start for the requests that follow: in the background
                self._spawn(self._start_instance(serving, REQUEST_STAGES, "scale_out", decision.device))
            return by_id[decision.instance_id], decision.size
        if decision.action == "start":
            instance = await self._start_instance(serving, REQUEST_STAGES, "libraries_preloaded", decision.device)
            if instance.state != "ready":  # drained while it started (the function was deleted or updated)
                return None
            return instance, max(1, min(view.slo_batch, view.worker_capacity) - instance.in_flight)
        if decision.action == "await_start":
            await by_id[decision.instance_id].ready_event.wait()
            return None
        if not view.instances and not view.start_options:
            current = self.specs[spec.name]
            raise InstanceUnavailable(
                f"function {spec.name} was updated to version {current.version} while this request waited, and no "
                f"instance of version {spec.version} is left to answer it as accepted; send it again")
        return None

    def _is_worker(self, pid: int) -> bool:
        return any(i.pid == pid for i in self.table.all())

    def _is_base_pass_member(self, pid: int) -> bool:
        return any(i.pid == pid and i.in_shared_base for i in self.table.all())

    def _start_order(self, spec: FunctionSpec) -> list[str]:
        """The devices, best first for a new instance of `spec` (devices.py; the view only with several)."""
        return start_order(self.config.device_names, spec.name, self.policy.view, self.scheduler.placement)

    @property
    def compute_slots(self) -> int:
        """Per device: instances it runs at full speed at once."""
        if self.config.compute_slots is not None:
            return self.config.compute_slots
        if self.config.cpu:
            return max(1, (os.cpu_count() or 1) // max(1, self.config.num_threads))
        return 1  # a GPU runs one instance's kernels at a time; batching, not more instances, fills it

    # -- instances -------------------------------------------------------------------------------------------------

    async def _start_instance(self, spec: FunctionSpec, stages: tuple[m.StageName, ...], kind: str,
                              device: str | None = None) -> Instance:
        """Start an instance of `spec` on `device` (None: the best for it, `_start_order`), bound to the daemon of
        its backbone there."""
        now = self.clock()
        device = device or self._start_order(spec)[0]
        instance = self.table.add(Instance("(starting)", Identity.of(spec), device, started_s=now, last_used_s=now))
        instance.backbone = spec.backbone
        scale_out = any(i.state == "ready" for i in self.table.current(spec))
        started = time.perf_counter()
        try:
            worker_spec = await asyncio.to_thread(  # may start the backbone daemon: off the event loop
                self.launcher.spec, spec.name, spec.backbone, self.adapter_path(spec.adapter_digest),
                max_batch_size=self.config.max_batch_size, num_threads=self.config.num_threads, deployment=spec.uid,
                device=device,
            )
            worker_spec = await asyncio.to_thread(  # an expert adapter's mode; may start the LoRA server
                with_lora_mode, worker_spec, spec.backbone, spec.lora_mode, self.lora_servers)
            if self.gate is not None:
                worker_spec = msgspec.structs.replace(worker_spec, step_gate=str(self.gate.path))
            if self.config.shared_base and spec.shared_base and self.config.cpu and \
                    worker_spec.daemon_socket:
                worker_spec = msgspec.structs.replace(
                    worker_spec, base_pass=str(base_pass_socket(Path(worker_spec.daemon_socket))))
            instance.backbone_bytes = await asyncio.to_thread(self._backbone_bytes, spec.backbone)
            instance.instance_id = worker_spec.instance_id
            instance.handle = await asyncio.to_thread(self.launcher.launch, worker_spec)
            instance.instance_id = instance.handle.spec.instance_id  # a pod adopted after a restart keeps its id
            instance.cold_start["spawn"] = time.perf_counter() - started
            instance.client = await instance.handle.connect()
            for stage in stages:
                done = await instance.client.stage(stage)
                instance.cold_start[stage] = done.seconds
                instance.loaded.add(stage)
                if stage == "adapter" and done.adapter is not None:
                    instance.adapter = msgspec.to_builtins(done.adapter)
        except (LorafaasError, OSError) as exc:
            self._record_failure(instance, f"start failed: {exc}")
            self.table.transition(instance, "crashed", "start failed")
            await self._kill(instance)
            raise InstanceUnavailable(f"function {spec.name}: starting an instance failed: {exc}") from exc
        except BaseException:  # cancelled (the agent is stopping): leave no process behind
            self.table.transition(instance, "crashed", "start cancelled")
            await asyncio.shield(self._kill(instance))
            raise
        instance.cold_start["total"] = time.perf_counter() - started
        instance.staged = True
        instance.start_kind = kind
        instance.last_used_s = instance.last_progress_s = instance.ready_s = self.clock()
        self._spawn(self._watch(instance))
        if not self.table.transition(instance, "ready") and instance.state == "draining":
            self._finish_drain(instance)  # deleted or updated while it started: it serves only what waits for it
        self.last_cold_start[spec.name] = dict(instance.cold_start)
        if scale_out:  # a first start may also start the backbone's daemon; a scale-out binds to it
            self.last_scale_out_s[spec.name] = instance.cold_start["total"]
        self.policy.record_cold_start(spec, instance.cold_start)
        self.num_cold_starts[spec.name, kind] = self.num_cold_starts.get((spec.name, kind), 0) + 1
        self.admission.wake(spec.name)
        log.info("%s: instance %s (pid %s) started in %.0f ms (%s)", spec.name, instance.instance_id, instance.pid,
                 instance.cold_start["total"] * 1e3, kind)
        return instance

    def _backbone_bytes(self, backbone: str) -> int:
        """The backbone's size as its store manifest records it; 0 when the store cannot say (never fatal)."""
        try:
            return self.launcher.store.get(backbone).bytes
        except (LorafaasError, OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("%s: backbone size unknown, not charged to its functions: %s", backbone, exc)
            return 0

    async def _watch(self, instance: Instance) -> None:
        await instance.client.wait_closed()
        if instance.state in ("ready", "draining"):
            self.num_restarts[instance.function] = self.num_restarts.get(instance.function, 0) + 1
            self._record_failure(instance, "exited unexpectedly")
            self.table.transition(instance, "crashed", "exited unexpectedly")
            await self._kill(instance)
            self.admission.wake(instance.function)
            if instance.function in self.specs:
                self._spawn(self._reconcile(instance.function))

    def _record_failure(self, instance: Instance, reason: str) -> None:
        kind = "hung" if reason.startswith("hung") else "start_failed" if reason.startswith("start") else "crashed"
        self.num_failures[instance.function, kind] = self.num_failures.get((instance.function, kind), 0) + 1
        log.warning("%s: instance %s (pid %s) %s", instance.function, instance.instance_id, instance.pid, reason)
        crashes = self.crashes.setdefault(instance.function, [])
        crashes.append({"instance_id": instance.instance_id, "pid": instance.pid, "reason": reason,
                        "version": instance.version, "at": time.time()})
        del crashes[:-MAX_FAILURES_KEPT]

    async def _kill(self, instance: Instance, sig: int = 9) -> None:
        if instance.client is not None:
            await instance.client.close()
        if instance.handle is not None:
            await asyncio.to_thread(instance.handle.kill, sig, self.config.stop_timeout_s)
            with contextlib.suppress(ValueError):
                self.launcher.instances.remove(instance.handle)
            address = instance.handle.spec.socket_path
            if tcp_address(address) is None:  # a killed worker could not remove its own socket
                Path(address).unlink(missing_ok=True)

    async def stop_instance(self, instance: Instance, reason: str = "") -> None:
        if instance.state in ("stopping", "stopped", "crashed"):
            return
        if instance.staged and not instance.in_flight and self.on_keep_alive is not None:
            self.on_keep_alive(instance, self._idle_s(instance, self.clock()), self._idle_bytes(instance))
        self.table.transition(instance, "stopping", reason)
        if instance.client is not None:
            with contextlib.suppress(LorafaasError, OSError):
                await instance.client.shutdown()
        await self._kill(instance, 15)
        self.table.transition(instance, "stopped")
        self.admission.wake(instance.function)

    # -- liveness --------------------------------------------------------------------------------------------------

    def _check_liveness(self) -> None:
        """Ask every instance that holds requests and has sent nothing for a while for a heartbeat."""
        now = self.clock()
        for instance in self.table.all():
            if (instance.state in ("ready", "draining") and instance.in_flight and instance.client is not None
                    and now - instance.last_progress_s >= self.config.heartbeat_after_s
                    and instance not in self._probes):
                task = asyncio.create_task(self._probe(instance))
                self._probes[instance] = task
                task.add_done_callback(lambda _t, i=instance: self._probes.pop(i, None))

    async def _probe(self, instance: Instance) -> None:
        try:
            stats = await asyncio.wait_for(instance.client.stats(), self.config.hang_timeout_s)
        except TimeoutError:
            await self._hung(instance, f"answered no heartbeat within {self.config.hang_timeout_s:g} s while "
                                       f"holding {instance.in_flight} request(s)")
            return
        except (LorafaasError, OSError):
            return  # it went away: its watcher reports the crash
        now = self.clock()
        if stats.num_steps != instance.num_steps:
            instance.num_steps = stats.num_steps
            instance.last_progress_s = now
        elif instance.in_flight and now - instance.last_progress_s >= self.config.hang_after_steps_s:
            await self._hung(instance, f"made no progress for {now - instance.last_progress_s:.0f} s while holding "
                                       f"{instance.in_flight} request(s)")

    async def _hung(self, instance: Instance, reason: str) -> None:
        """Fail or retry its requests (closing the connection ends their streams), kill it, replace it."""
        if not self.table.transition(instance, "hung", reason):
            return
        instance.hung = reason
        self._record_failure(instance, f"hung: {reason}")
        self.num_restarts[instance.function] = self.num_restarts.get(instance.function, 0) + 1
        self.table.transition(instance, "stopping", "hung")
        await self._kill(instance)
        self.table.transition(instance, "stopped")
        self.admission.wake(instance.function)
        if instance.function in self.specs:
            self._spawn(self._reconcile(instance.function))

    # -- reconciliation --------------------------------------------------------------------------------------------

    async def _reconcile_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.reconcile_interval_s)
            self._check_liveness()
            for instance in self.table.all():
                if instance.state == "draining":
                    self._finish_drain(instance)
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
        in_use = {(i.backbone, i.device) for i in self.table.all()}
        for device in self.config.device_names:
            for backbone in self.launcher.running_backbones(device):
                if (backbone, device) not in in_use:
                    await asyncio.to_thread(self.launcher.stop_daemon, backbone, device)

    async def _reconcile(self, name: str) -> None:
        """min_instances ready (pre-warmed, all artifacts); idle instances past keep-alive retired."""
        spec = self.specs.get(name)
        if spec is None:
            return
        current = self.table.current(spec)
        for _ in range(spec.min_instances - len(current)):
            if self.specs.get(name) != spec:
                return  # changed while an instance started: the next round reconciles the new spec
            await self._start_instance(spec, stages=m.STAGES, kind="prewarm")
        for instance, why in self.retirements(spec):
            await self.stop_instance(instance, why)

    def retirements(self, spec: FunctionSpec) -> list[tuple[Instance, str]]:
        """The idle instances to stop now, least recently used first, never below `min_instances`: those past the
        keep-alive window; else, while the function is idle as a whole and its window comes from the idle-time
        histogram, one per `idle_retire_step_s` (`Scheduler.next_idle_retirement_s`; a stepped retirement returned is
        recorded as done). A keep-alive the function's spec sets is kept as set."""
        now, keep_alive_s = self.clock(), self.keep_alive_s(spec)
        current = self.table.current(spec)
        surplus = max(0, len(current) - spec.min_instances)
        idle = sorted((i for i in current if i.state == "ready" and i.in_flight == 0), key=lambda i: i.last_used_s)
        expired = [(i, f"idle for {now - i.last_used_s:.1f} s (keep-alive {keep_alive_s:.1f} s)")
                   for i in idle if now - i.last_used_s >= keep_alive_s][:surplus]
        if expired or not surplus or len(idle) < len(current) or self.admission.queued(spec.name):
            return expired
        idle_since = max(i.last_used_s for i in idle)
        due = self.scheduler.next_idle_retirement_s(spec.name, idle_since, self.idle_retired_s.get(spec.name))
        if due is None or now < due:
            return []
        self.idle_retired_s[spec.name] = now
        return [(idle[0], f"function idle for {now - idle_since:.1f} s: one instance per "
                          f"{self.config.scheduler.idle_retire_step_s:.0f} s")]

    def keep_alive_s(self, spec: FunctionSpec) -> float:
        """The function's own keep-alive, unless the hybrid policy has a representative idle-time histogram."""
        if self.config.scheduler.keep_alive_policy == "hybrid":
            decision = self.scheduler.keep_alive(spec.name)
            if decision.reason == "histogram":
                return decision.prewarm_s + decision.keep_alive_s
        return spec.keep_alive_s

    async def _roll(self, previous: FunctionSpec, spec: FunctionSpec) -> None:
        """A new adapter (or LoRA mode): the new version's instance is ready before the old ones drain. Instances
        of the old version serve only the requests accepted for it; none starts for it again."""
        old = [i for i in self.table.of_function(spec.name)
               if i.identity.uid == spec.uid and i.identity != Identity.of(spec)
               and i.state in ("starting", "ready")]
        if any(i.state == "ready" for i in old):
            try:
                await self._start_instance(spec, stages=m.STAGES, kind="redeploy")
            except LorafaasError as exc:  # the old version still drains: requests now see the new one's error
                log.warning("%s: version %d did not start: %s", spec.name, spec.version, exc.message)
        for instance in old:
            self._drain(instance, f"updated to version {spec.version}")

    def _spawn(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)

    # -- views -------------------------------------------------------------------------------------------------------

    def describe(self, name: str) -> list[dict]:
        return [i.describe() for i in self.table.of_function(name)]

    def admission_state(self, spec: FunctionSpec) -> dict:
        """What the admission policy last decided for the function and why (e.g. why a request waited)."""
        decision = self.last_admission.get(spec.name)
        return {"queued": self.admission.queued(spec.name),
                "last_decision": decision.action if decision else None,
                "reason": decision.reason if decision else None,
                "waits": dict(self.waits.get(spec.name, {}))}

    def offloaded(self, name: str) -> list[dict]:
        return self.policy.describe(name)

    def failures(self, name: str) -> list[dict]:
        """Instances of the function that failed: crashed, hung or failed to start here, and what the backend saw
        (a pod that could not be scheduled, pull its image or stay alive)."""
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

    def failure_counts(self) -> dict[tuple[str, str], int]:
        return dict(list(self.num_failures.items()))  # a one-step copy: /metrics reads it from another thread

    def count_by_state(self) -> dict[tuple[str, str], int]:
        return self.table.count_by_state()


def _adapter_bytes(instance: Instance) -> int:
    return int((instance.adapter or {}).get("held_bytes", 0))


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        exc = task.exception()
        message = exc.message if isinstance(exc, LorafaasError) else repr(exc)
        log.warning("background task failed: %s", message)
