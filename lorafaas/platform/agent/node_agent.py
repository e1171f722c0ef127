"""The node agent: function instances on this machine, from cold start to scale-to-zero.

Each deployed function has one `FunctionState` (function_state.py), created on apply and dropped on remove, so
nothing of a deleted function outlives it. Instances live in one `InstanceTable` (explicit states, every transition
in one place) and serve exactly one identity: tenant, function, deployment uid, version and adapter; `Instances`
(instances.py) starts, stops and watches their processes, `ArtifactPlanner` (artifacts.py) carries out the
scheduler's pre-load and offload plans. For each function the agent routes queued requests as the scheduler's
admission policy decides (`lorafaas.scheduler.admission`, the view built in admission_view.py), keeps
`min_instances` ready, retires instances idle past their keep-alive, replaces crashed and hung ones, and on update
either relabels its instances (settings only) or starts the new adapter's instance before draining the old ones.
Deleting a function drains it: queued requests fail at once, a start in progress is stopped, its instances stop
once the requests they hold are done.

All mutations happen on the event loop, between awaits, so no locks. The agent drives the CPU or one or more GPUs
(`AgentConfig.devices`); where an instance starts is in devices.py.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncGenerator, Callable, Coroutine
from pathlib import Path
from typing import Any

from lorafaas.errors import FunctionNotFound, InstanceHung, InstanceUnavailable, LorafaasError
from lorafaas.function_runtime import messages as m
from lorafaas.platform.admission import Admission
from lorafaas.platform.agent.admission_view import admission_view_of
from lorafaas.platform.agent.artifacts import ArtifactPlanner
from lorafaas.platform.agent.catalogue import ArtifactCatalogue
from lorafaas.platform.agent.config import REQUEST_STAGES, AgentConfig, same_worker
from lorafaas.platform.agent.function_state import FunctionState
from lorafaas.platform.agent.idle_budget import budget_retirements
from lorafaas.platform.agent.instances import Instances
from lorafaas.platform.agent.observations import observe_prefill
from lorafaas.platform.agent.retirement import retirements
from lorafaas.platform.agent.views import describe_function
from lorafaas.platform.backends.base import Backend
from lorafaas.platform.backends.lora_servers import LoraServers
from lorafaas.platform.compute_gate import ComputeGate
from lorafaas.platform.descriptions import FunctionDescription
from lorafaas.platform.devices import start_order
from lorafaas.platform.instance_table import Identity, Instance, InstanceTable
from lorafaas.platform.metering import DeviceShareClock, UsageMeter
from lorafaas.platform.state.records import FunctionSpec
from lorafaas.scheduler import AdmissionView, ComputeTurns, FunctionName, InstanceId, Scheduler, decide_admission

log = logging.getLogger(__name__)
RECONCILE_YIELD_EVERY = 100  # functions reconciled between two turns of the event loop


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
        self.config = config or AgentConfig()
        self.clock = clock
        self.functions: dict[str, FunctionState] = {}  # every function deployed here, by name
        self.table = InstanceTable()
        # the queues waiting for this device's compute; a queue that went away unannounced stops counting after 1 s
        # (a waiting dispatcher asks again every POLL_S)
        self.compute_turns = ComputeTurns(stale_after_s=1.0)
        self.scheduler = Scheduler(self.config.scheduler, random.Random(0))
        self.admission = Admission(self.scheduler, self.clock, self._acquire, self.config.fill_or_expire)
        self.instances = Instances(launcher, self.config, self.table, adapter_path, clock, lora_servers,
                                   self.state_of, self._instance_ready, self._instance_gone, self._spawn)
        self.catalogue = ArtifactCatalogue(lambda: launcher.store, adapter_path)
        self.planner = ArtifactPlanner(self.config, self.table, launcher, self.scheduler, self.functions,
                                       self.catalogue, self.instances)
        self.device_share = DeviceShareClock(self.clock)  # what each request's share of the device is (metering)
        self._tasks: set[asyncio.Task] = set()
        self._reconciler: asyncio.Task | None = None

    @property
    def specs(self) -> dict[str, FunctionSpec]:
        """The current spec of every function deployed here (a copy)."""
        return {name: state.spec for name, state in self.functions.items()}

    @property
    def gate(self) -> ComputeGate | None:
        return self.instances.gate

    @property
    def compute_slots(self) -> int:
        """Per device: instances it runs at full speed at once."""
        return self.instances.slots

    def state_of(self, instance: Instance) -> FunctionState | None:
        """The record of the deployment `instance` serves; None for a deleted (or replaced) deployment's."""
        state = self.functions.get(instance.function)
        return state if state is not None and state.owns(instance.identity.uid) else None

    # -- lifecycle -------------------------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.instances.start_pool()
        self._reconciler = asyncio.create_task(self._reconcile_forever())

    async def adopt(self) -> int:
        """Take over the instances a previous controller left running (`Backend.adoptable`: pods after an upgrade)
        for the functions deployed here, so that they serve warm; the others the backend deletes after its adopt
        window. Returns how many were adopted."""
        left = await asyncio.to_thread(self.launcher.adoptable)
        starts = []
        for worker in left:
            state = self.functions.get(worker.function)
            if state is None or worker.deployment != state.spec.uid:
                continue
            if worker.adapter_dir != str(self.instances.adapter_path(state.spec.adapter_digest)):
                continue  # an older version's adapter: not what the function serves now
            starts.append(self.instances.start(state.spec, REQUEST_STAGES, "prewarm", self._start_order(state.spec)[0]))
        started = await asyncio.gather(*starts, return_exceptions=True)
        for failure in [s for s in started if isinstance(s, LorafaasError)]:
            log.warning("adopting an instance failed: %s", failure.message)
        adopted = sum(1 for s in started if isinstance(s, Instance) and s.start_kind == "adopted")
        if left:
            log.info("adopted %d of %d instance(s) a previous controller left running", adopted, len(left))
        return adopted

    async def stop(self) -> None:
        if self._reconciler:
            self._reconciler.cancel()
        for task in self._tasks:
            task.cancel()
        await self.instances.close()

    def apply(self, spec: FunctionSpec) -> None:
        """Adopt a function's spec: a new function, or a new version of one. A settings-only version keeps its
        instances (they answer alike); a new adapter or LoRA mode rolls (the new version's instance is ready before
        the old ones drain). The reconciler starts, drains and retires instances."""
        if self.config.scheduler.preloading and not any(s.spec.backbone == spec.backbone
                                                        for s in self.functions.values()):
            self._spawn(self.instances.prepare_backbone(spec.backbone))
        state = self.functions.get(spec.name)
        if state is None or not state.owns(spec.uid):
            # a new deployment: a record of its own, with its adapter's size read once, now
            self.functions[spec.name] = FunctionState(spec, self.catalogue.adapter_bytes(spec.adapter_digest))
            if state is not None:  # under a name in use: the old deployment goes
                self._forget(state.spec)
                self._drain_deployment(state.spec, f"function {spec.name} was deployed again")
        else:
            previous, state.spec = state.spec, spec
            if previous.adapter_digest != spec.adapter_digest:
                state.adapter_bytes = self.catalogue.adapter_bytes(spec.adapter_digest)
            if previous.version != spec.version:
                if same_worker(previous, spec):
                    moved = self.table.relabel(Identity.of(previous), Identity.of(spec))
                    log.info("%s: version %d changes settings only: %d instance(s) serve it as they are", spec.name,
                             spec.version, moved)
                    self.admission.wake(spec.name)
                else:
                    self._spawn(self._roll(previous, spec))
        self._spawn(self._reconcile(spec.name))

    async def remove(self, name: str) -> None:
        """Delete a function: its queued requests fail at once, a start in progress stops, nothing new starts or is
        dispatched for it, and its instances stop once the requests they hold are done. Its record goes with it."""
        state = self.functions.pop(name, None)
        if state is None:
            return
        self._forget(state.spec)
        self._drain_deployment(state.spec, f"function {name} was deleted")
        if self.instances.lora_servers is not None and all(s.spec.backbone != state.spec.backbone
                                                           for s in self.functions.values()):
            await asyncio.to_thread(self.instances.lora_servers.stop, state.spec.backbone)  # its backbone's last

    def _forget(self, spec: FunctionSpec) -> None:
        """What the scheduler, the compute turns and the catalogue learned of a deployment that is gone."""
        self.scheduler.forget(FunctionName(spec.name))
        self.catalogue.retain(s.spec.backbone for s in self.functions.values())
        self.compute_turns.leave(Identity.of(spec))
        self.launcher.forget_failures(spec.name)

    def _drain_deployment(self, spec: FunctionSpec, reason: str) -> None:
        failed = self.admission.fail(lambda identity: identity.function == spec.name and identity.uid == spec.uid,
                                     FunctionNotFound(f"{reason} while this request waited"))
        if failed:
            log.info("%s: %d queued request(s) failed: %s", spec.name, failed, reason)
        for instance in self.table.of_function(spec.name):
            if instance.identity.uid == spec.uid:
                if instance.state == "starting":  # nothing is left for it to serve
                    self.instances.abort_start(instance, f"its deployment went ({reason})")
                self._drain(instance, reason)

    def _drain(self, instance: Instance, reason: str) -> None:
        if instance.state in ("starting", "ready"):
            self.table.transition(instance, "draining", reason)
        self._finish_drain(instance)

    def _finish_drain(self, instance: Instance) -> None:
        """A draining instance stops once it holds no request and none is queued for its identity."""
        if (instance.state == "draining" and instance.staged and not instance.in_flight
                and not self.admission.queue_length(instance.identity)):
            self._spawn(self.instances.stop(instance, "drained"))

    # -- instance events -------------------------------------------------------------------------------------------

    def _instance_ready(self, instance: Instance) -> None:
        if instance.state == "draining":  # deleted or updated while it started: it serves only what waits for it
            self._finish_drain(instance)  # (draining -> ready is no transition: it raised, a 500 to its request)
        else:
            self.table.transition(instance, "ready")
        self.admission.wake(instance.function)

    def _instance_gone(self, instance: Instance, failed: bool) -> None:
        self.admission.wake(instance.function)
        if failed and self.state_of(instance) is not None:
            self._spawn(self._reconcile(instance.function))

    # -- invocation ------------------------------------------------------------------------------------------------

    async def invoke(self, spec: FunctionSpec, request: m.Generate, meter: UsageMeter | None = None
                     ) -> AsyncGenerator[m.Token | m.Finished, None]:
        """Stream one request's events. It waits in its identity's queue until the admission policy dispatches it;
        a request that fails before its first token is retried once elsewhere (never on another identity).
        `meter`, when given, is complete when `Finished` is yielded: times, cold start and charges (metering.py)."""
        state = self.functions.get(spec.name)
        if state is None or not state.owns(spec.uid):
            raise FunctionNotFound(f"function {spec.name} was deleted")
        now = self.clock()
        self.scheduler.observe_arrival(state.name, now)
        if state.last_end_s is not None and not self._in_flight(state):  # an idle period ends: keep-alive histogram
            self.scheduler.observe_idle(state.name, now - state.last_end_s)
        meter = meter or UsageMeter()
        meter.arrived_s = self.clock()
        for attempt in (1, 2):
            admitted = await self.admission.admit(spec)
            instance, dispatched = admitted.instance, self.clock()
            instance.last_progress_s = dispatched
            state.most_in_flight = max(state.most_in_flight, instance.in_flight)
            self.table.record_busy(instance.device)
            produced = False
            tokens = self.planner.request_tokens(request)
            if self.config.scheduler.offloading:
                try:
                    await self.planner.make_room(spec, tokens, instance.device)
                except BaseException:
                    self._release(state, instance)
                    raise
            state.in_flight_tokens += tokens
            meter.charge_dispatch(self.table, instance, dispatched)
            share_mark: float | None = self.device_share.enter()
            try:
                assert instance.client is not None
                async for event in instance.client.generate(request):
                    instance.last_progress_s = self.clock()
                    if not produced:
                        produced = True
                        meter.first_event_s = instance.last_progress_s
                        self.instances.record_first_token(instance, event, self.clock() - dispatched)
                        instance.loaded.update(REQUEST_STAGES)  # the worker reloads whatever was offloaded
                        if self._current(state):  # a deleted deployment's requests teach its successor nothing
                            observe_prefill(self.scheduler, state.spec, admitted.batch_size, event,
                                            self.clock() - dispatched)
                    if isinstance(event, m.Token):
                        meter.completion_tokens += 1
                        if event.prompt_tokens is not None:
                            meter.prompt_tokens = event.prompt_tokens
                    if isinstance(event, m.Finished) and share_mark is not None:  # charged now: the caller may
                        meter.prompt_tokens, meter.completion_tokens = event.prompt_tokens, event.completion_tokens
                        meter.finished_s = instance.last_progress_s  # never pull past it
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
                state.in_flight_tokens = max(0, state.in_flight_tokens - tokens)
                self._release(state, instance)

    def _release(self, state: FunctionState, instance: Instance) -> None:
        """A request admitted to `instance` is over."""
        instance.in_flight -= 1
        instance.last_used_s = self.clock()
        if not self._in_flight(state):
            state.last_end_s = self.clock()
        self.admission.wake(instance.function)
        if instance.in_flight == 0:  # a compute slot may be free: the longest waiting queue looks at once
            for waiting in self.compute_turns.waiting(instance.last_used_s)[:1]:
                if isinstance(waiting, Identity):
                    self.admission.wake(waiting.function)
        if instance.state == "draining":
            self._finish_drain(instance)

    def _current(self, state: FunctionState) -> bool:
        """Whether `state` is still the record of its name (what it observes may teach the scheduler)."""
        return self.functions.get(state.name) is state

    def _in_flight(self, state: FunctionState) -> int:
        return sum(i.in_flight for i in self.table.of_function(state.name) if state.owns(i.identity.uid))

    # -- admission -------------------------------------------------------------------------------------------------

    def serving_spec(self, spec: FunctionSpec) -> FunctionSpec:
        """The spec whose instances may answer a request accepted with `spec`: the current one when it answers
        alike, else `spec` itself (an older adapter: only its draining instances). FunctionNotFound when the
        deployment is gone."""
        state = self.functions.get(spec.name)
        if state is None or not state.owns(spec.uid):
            raise FunctionNotFound(f"function {spec.name} was deleted while this request waited")
        if state.spec.version == spec.version or same_worker(state.spec, spec):
            return state.spec
        return spec

    def admission_view(self, spec: FunctionSpec, queue_length: int) -> AdmissionView:
        """The function as the admission policy sees it (admission_view.py)."""
        state = self.functions.get(spec.name)
        current = state is not None and state.spec == spec
        return admission_view_of(self.config, self.table, self.scheduler, self.compute_turns, spec, queue_length,
                                 current, lambda: self._start_order(spec),
                                 state.last_scale_out_s if state else None, self.clock())

    async def _acquire(self, spec: FunctionSpec, queue_length: int) -> tuple[Instance, int] | None:
        """Carry out the admission policy for `queue_length` requests accepted with `spec`: (an instance, how many
        it takes now), or None to wait. Raises FunctionNotFound for a deleted function, InstanceUnavailable for
        requests of a superseded adapter that no instance is left to serve, or a failed start."""
        serving = self.serving_spec(spec)
        state = self.functions[spec.name]
        view = self.admission_view(serving, queue_length)
        decision = decide_admission(view)
        state.last_admission = decision
        identity = Identity.of(serving)
        self.compute_turns.note(identity, decision, self.clock())
        if decision.action in ("wait", "await_start"):
            state.record_wait(decision.reason)
        by_id = {i.instance_id: i for i in self.table.of_identity(identity)}
        if decision.action == "dispatch":
            if decision.device is not None:  # a slow start for the requests that follow: in the background
                self._spawn(self.instances.start(serving, REQUEST_STAGES, "scale_out", decision.device))
            return by_id[_named(decision.instance_id)], decision.size
        if decision.action == "start":
            device = decision.device or self._start_order(serving)[0]
            try:
                instance = await self.instances.start(serving, REQUEST_STAGES, "libraries_preloaded", device)
            except InstanceUnavailable:
                self.serving_spec(spec)  # FunctionNotFound when the function went while it started
                raise
            if instance.state != "ready":  # drained while it started (the function was deleted or updated)
                return None
            return instance, max(1, min(view.slo_batch, view.worker_capacity) - instance.in_flight)
        if decision.action == "await_start":
            await by_id[_named(decision.instance_id)].ready_event.wait()
            return None
        if not view.instances and not view.start_options:
            raise InstanceUnavailable(
                f"function {spec.name} was updated to version {state.spec.version} while this request waited, and "
                f"no instance of version {spec.version} is left to answer it as accepted; send it again")
        return None

    def _start_order(self, spec: FunctionSpec) -> list[str]:
        """The devices, best first for a new instance of `spec` (devices.py; the view only with several)."""
        return start_order(self.config.device_names, spec.name, self.planner.view, self.scheduler.placement)

    # -- reconciliation --------------------------------------------------------------------------------------------

    async def _reconcile_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.reconcile_interval_s)
            self.instances.check_liveness()
            for instance in self.table.all():
                if instance.state == "draining":
                    self._finish_drain(instance)
            for index, name in enumerate(list(self.functions)):
                if index % RECONCILE_YIELD_EVERY == RECONCILE_YIELD_EVERY - 1:
                    await asyncio.sleep(0)  # a thousand functions' round does not hold requests (and /healthz) up
                try:
                    await self._reconcile(name)
                except LorafaasError as exc:
                    log.warning("%s: reconcile failed: %s", name, exc.message)
            for instance, why in budget_retirements(self.functions, self.table, self.scheduler, self.config,
                                                    self.clock()):
                await self.instances.stop(instance, why)
            await asyncio.sleep(0)
            try:
                await self.planner.tick(self.clock())
            except LorafaasError as exc:
                log.warning("pre-load plan failed: %s", exc.message)

    async def _reconcile(self, name: str) -> None:
        """min_instances ready (pre-warmed, all artifacts); idle instances past keep-alive retired."""
        state = self.functions.get(name)
        if state is None:
            return
        spec = state.spec
        current = self.table.current(spec)
        if not current and spec.min_instances == 0:
            return  # most of a fleet, most of the time: nothing to start or retire
        for _ in range(spec.min_instances - len(current)):
            if self.functions.get(name) is not state or state.spec != spec:
                return  # changed while an instance started: the next round reconciles the new spec
            await self.instances.start(spec, m.STAGES, "prewarm", self._start_order(spec)[0])
        for instance, why in self.retirements(spec):
            await self.instances.stop(instance, why)

    def retirements(self, spec: FunctionSpec) -> list[tuple[Instance, str]]:
        """The idle instances of `spec` to stop now (retirement.py)."""
        return retirements(self.functions[spec.name], self.table, self.scheduler, self.config,
                           self.admission.queued(spec.name), self.clock())

    async def _roll(self, previous: FunctionSpec, spec: FunctionSpec) -> None:
        """A new adapter (or LoRA mode): the new version's instance is ready before the old ones drain. Instances
        of the old version serve only the requests accepted for it; none starts for it again."""
        old = [i for i in self.table.of_function(spec.name)
               if i.identity.uid == spec.uid and i.identity != Identity.of(spec)
               and i.state in ("starting", "ready")]
        if any(i.state == "ready" for i in old):
            try:
                await self.instances.start(spec, m.STAGES, "redeploy", self._start_order(spec)[0])
            except LorafaasError as exc:  # the old version still drains: requests now see the new one's error
                log.warning("%s: version %d did not start: %s", spec.name, spec.version, exc.message)
        for instance in old:
            self._drain(instance, f"updated to version {spec.version}")

    def _spawn(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)

    # -- views -------------------------------------------------------------------------------------------------------

    def describe(self, spec: FunctionSpec) -> FunctionDescription:
        """What `describe` shows of this deployment's life here (never a deleted namesake's)."""
        state = self.functions.get(spec.name)
        if state is None or not state.owns(spec.uid):
            raise FunctionNotFound(f"function {spec.name} was deleted")
        return describe_function(state, self.table, self.scheduler, self.config, self.admission.queued(spec.name),
                                 self.launcher.describe_failures(spec.name, since=spec.created_at))

    def record_registration(self, spec: FunctionSpec, stages: dict[str, float]) -> None:
        """A deployment's registration, stage by stage: in its record (describe) and the node's per-stage sums."""
        state = self.functions.get(spec.name)
        if state is not None and state.owns(spec.uid):
            state.registration = dict(stages)
        self.instances.start_stages.observe({f"register_{stage}": seconds for stage, seconds in stages.items()})

    def start_stage_totals(self) -> dict[str, tuple[int, float]]:
        """Every instance start's stages on this node: stage -> (count, seconds summed)."""
        return self.instances.start_stages.snapshot()

    def cold_start_counts(self) -> dict[tuple[str, str], int]:
        """(function, kind) -> cold starts, of the functions deployed now (/metrics reads it from another thread:
        one-step copies only)."""
        return {(name, kind): n for name, state in list(self.functions.items())
                for kind, n in list(state.cold_starts.items())}

    def failure_counts(self) -> dict[tuple[str, str], int]:
        """(function, crashed | hung | start_failed) -> count, of the functions deployed now."""
        return {(name, kind): n for name, state in list(self.functions.items())
                for kind, n in list(state.failure_counts.items())}

    def count_by_state(self) -> dict[tuple[str, str], int]:
        return self.table.count_by_state()


def _named(instance_id: InstanceId | None) -> str:
    """The instance a dispatch or an await decision always names."""
    if instance_id is None:
        raise ValueError("an admission decision to dispatch or await without its instance")
    return instance_id


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        exc = task.exception()
        message = exc.message if isinstance(exc, LorafaasError) else repr(exc)
        log.warning("background task failed: %s", message)
