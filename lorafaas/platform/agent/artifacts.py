"""The node agent's side of the scheduler: this node described as a `ClusterView`, and the scheduler's artifact
actions carried out on real processes.

How lorafaas' artifacts map onto the scheduler's model (CPU: host and device are one memory with one budget):

    libraries      host    the library pool (zygote) or the instance's own process: always loaded where a slot is
    backbone       device  the backbone daemon's shared segment, counted once per device; an instance binds to it
    adapter        device  placed beside the bound backbone in an idle instance (`stage adapter`);
                   host    read but not placed (after `unstage adapter_offload`)
    warmup         device  an idle instance's warm-up pass

Every device the agent drives is a `DeviceView` with its own budget; an instance's artifacts are resident on its own
device, a backbone on each device whose daemon serves it. Worker slots are the function instances (bound to their
function) and, for a function with no instance, one free slot of the library pool, through which only its backbone
can be kept resident: no instance is created to pre-load.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

from lorafaas.errors import LorafaasError
from lorafaas.function_runtime import messages as m
from lorafaas.platform.agent.catalogue import ArtifactCatalogue
from lorafaas.platform.agent.config import AgentConfig
from lorafaas.platform.agent.function_state import FunctionState, OffloadEvent
from lorafaas.platform.agent.instances import Instances, device_slots
from lorafaas.platform.backends.base import Backend
from lorafaas.platform.instance_table import Instance, InstanceTable
from lorafaas.platform.state.records import FunctionSpec
from lorafaas.scheduler import (
    ArtifactCost,
    ArtifactCosts,
    BackboneName,
    ClusterView,
    DeviceId,
    DeviceView,
    FunctionName,
    FunctionProfile,
    InstanceId,
    InstanceView,
    Offload,
    Preload,
    Residency,
    Scheduler,
    SlotId,
    WorkerSlot,
)

log = logging.getLogger(__name__)

# Defaults until measured on this node (seconds): what each artifact costs a cold start.
DEFAULT_LOAD_S = {"libraries": 4.0, "backbone": 5.0, "adapter": 0.01, "warmup": 0.2}
INSTANCE_OVERHEAD_BYTES = 64 * 1024**2  # a worker's own memory besides the artifacts (interpreter, heaps, buffers)
POOL_SLOT_BYTES = 1024**4  # host memory is the device's on the CPU: slots are not the binding constraint
CHARS_PER_TOKEN = 4  # the agent does not tokenize: a prompt's tokens are estimated from its length

AdapterPrice = Callable[[FunctionState], tuple[int, float]]  # (bytes, load seconds) an adapter is priced at


def adapter_prices(states: Iterable[FunctionState], rank_aware: bool) -> AdapterPrice:
    """Each function's adapter at its own bytes and measured load; rank-blind, every one at the fleet's means."""
    def own(state: FunctionState) -> tuple[int, float]:
        return state.adapter_bytes, state.load_s.get("adapter", DEFAULT_LOAD_S["adapter"])

    if rank_aware:
        return own
    prices = [own(state) for state in states]
    mean = (sum(b for b, _ in prices) // max(1, len(prices)), sum(s for _, s in prices) / max(1, len(prices)))
    return lambda state: mean


class _IdleParts(NamedTuple):
    profile: FunctionProfile
    slot: WorkerSlot
    resident: tuple[Residency, ...]


class ArtifactPlanner:
    """The node's artifacts as the scheduler sees them (`view`) and its plans carried out on the instances: pre-loads
    on the periodic plan, offloads when a batch needs room. Used on the node agent's event loop."""

    def __init__(self, config: AgentConfig, table: InstanceTable, launcher: Backend, scheduler: Scheduler,
                 functions: Mapping[str, FunctionState], catalogue: ArtifactCatalogue, instances: Instances) -> None:
        self.config = config
        self.table = table
        self.launcher = launcher
        self.scheduler = scheduler
        self.functions = functions  # the agent's records, read live
        self.catalogue = catalogue  # the artifacts' sizes, read once (no file is read building a view)
        self.instances = instances
        self._deciding = asyncio.Lock()  # one offloading decision (and its actions) at a time
        self._idle_cache: dict[str, tuple[tuple, _IdleParts]] = {}  # function -> (what its parts read, the parts)
        self._last_plan_s = -1e9

    async def tick(self, now: float) -> None:
        """Pre-loading on: apply the knapsack's plan when rates moved (or every plan_interval_s). Off: nothing is
        kept ahead of requests, so a backbone no instance uses is unloaded."""
        if self.config.scheduler.preloading:
            if self.scheduler.should_replan(now) or now - self._last_plan_s >= self.config.plan_interval_s:
                self._last_plan_s = now
                await self.apply_plan(now)
            return
        in_use = {(i.backbone, i.device) for i in self.table.all()}
        for device in self.config.device_names:
            for backbone in self.launcher.running_backbones(device):
                if (backbone, device) not in in_use:
                    await asyncio.to_thread(self.launcher.stop_daemon, backbone, device)

    # -- the view ------------------------------------------------------------------------------------------------

    def view(self) -> ClusterView:
        names = self.config.device_names
        libraries_held = self.launcher.zygote_pid is not None  # the zygote holds them for every function's start
        functions: dict[FunctionName, FunctionProfile] = {}
        slots: list[WorkerSlot] = []
        resident: list[Residency] = []
        used = self._kv_bytes_by_device()  # bytes besides resident artifacts: KV caches, instances' own
        running_backbones = {d: set(self.launcher.running_backbones(d)) for d in names}
        invoked = frozenset(FunctionName(i.function) for i in self.table.all() if i.in_flight)
        instances = tuple(InstanceView(InstanceId(i.instance_id), FunctionName(i.function), DeviceId(i.device),
                                       frozenset(i.loaded), i.in_flight, self.config.max_batch_size)
                          for i in self.table.all() if i.state == "ready")
        price = adapter_prices(self.functions.values(), self.config.scheduler.rank_aware)
        for state in self.functions.values():
            spec, name = state.spec, FunctionName(state.name)
            pool = [i for i in self.table.current(spec) if i.state == "ready"]
            backbone_on = tuple(d for d in names if spec.backbone in running_backbones[d])
            if not pool:  # most of a fleet: its parts change only with what they are made of
                idle = self._idle_parts(state, price, libraries_held, backbone_on)
                functions[name] = idle.profile
                slots.append(idle.slot)
                resident.extend(idle.resident)
                continue
            functions[name] = self.profile(state, with_instance=True, price=price)
            for instance in pool:
                slot, device = SlotId(instance.instance_id), DeviceId(instance.device)
                slots.append(WorkerSlot(slot, POOL_SLOT_BYTES, function=name))
                used[instance.device] += INSTANCE_OVERHEAD_BYTES
                resident.append(Residency(name, "libraries", "host", slot=slot))
                loaded = set(instance.loaded)
                if "adapter" in loaded:
                    resident.append(Residency(name, "adapter", "device", device, slot))
                if "warmup" in loaded:
                    resident.append(Residency(name, "warmup", "device", device, slot))
            resident.extend(Residency(name, "backbone", "device", DeviceId(d), SlotId(pool[0].instance_id))
                            for d in backbone_on)
        if len(self._idle_cache) > len(self.functions):  # deleted functions' entries
            for gone in set(self._idle_cache) - set(self.functions):
                del self._idle_cache[gone]
        compute_slots = device_slots(self.config)  # placement avoids a device other functions keep busy
        devices = tuple(DeviceView(DeviceId(d.name), d.budget_bytes, used[d.name], compute_slots)
                        for d in self.config.devices)
        return ClusterView(functions=functions, devices=devices, slots=tuple(slots), resident=tuple(resident),
                           invoked=invoked, instances=instances)

    def _idle_parts(self, state: FunctionState, price: AdapterPrice, libraries_held: bool,
                    backbone_on: tuple[str, ...]) -> _IdleParts:
        """A function's parts of the view while it has no ready instance: made again only when what they are made
        of changed (its spec, adapter price, measured loads, the backbone's daemon start, the libraries' import)."""
        key = (state.spec, price(state), tuple(state.load_s.items()),
               self.instances.daemon_start_s.get(state.spec.backbone), self.instances.library_import_s,
               libraries_held, backbone_on)
        cached = self._idle_cache.get(state.name)
        if cached is not None and cached[0] == key:
            return cached[1]
        name = FunctionName(state.name)
        slot = SlotId(f"pool:{name}")
        resident = [Residency(name, "libraries", "host", slot=slot)] if libraries_held else []
        resident += [Residency(name, "backbone", "device", DeviceId(d), slot) for d in backbone_on]
        parts = _IdleParts(self.profile(state, with_instance=False, price=price),
                           WorkerSlot(slot, POOL_SLOT_BYTES, function=name), tuple(resident))
        self._idle_cache[state.name] = (key, parts)
        return parts

    def _kv_bytes_by_device(self) -> dict[str, int]:
        """The KV bytes of the requests running, on the devices of the instances that hold them (a function's
        estimate split by their requests)."""
        kv = dict.fromkeys(self.config.device_names, 0)
        holding: dict[str, list[Instance]] = {}
        for instance in self.table.all():
            if instance.in_flight:
                holding.setdefault(instance.function, []).append(instance)
        for name, instances in holding.items():
            state = self.functions.get(name)
            if state is None:
                continue
            holders = [i for i in instances if state.owns(i.identity.uid)]
            total = sum(i.in_flight for i in holders)
            for instance in holders:
                share = state.in_flight_tokens * instance.in_flight // total
                kv[instance.device] = kv.get(instance.device, 0) + self.request_bytes(state.spec, share)
        return kv

    def profile(self, state: FunctionState, with_instance: bool, price: AdapterPrice | None = None
                ) -> FunctionProfile:
        spec = state.spec
        backbone = self.catalogue.backbone(spec.backbone)
        # its own (read when applied, load measured), or rank-blind's mean
        adapter_bytes, adapter_s = (price or adapter_prices((), rank_aware=True))(state)

        def load_s(kind: str) -> float:
            return state.load_s.get(kind, DEFAULT_LOAD_S[kind])

        daemon_s = self.instances.daemon_start_s.get(spec.backbone, DEFAULT_LOAD_S["backbone"])
        backbone_s = daemon_s + load_s("backbone")
        costs = ArtifactCosts(
            libraries=ArtifactCost(self.instances.library_import_s or DEFAULT_LOAD_S["libraries"], 0),
            backbone_device=ArtifactCost(backbone_s, backbone.weight_bytes),
            # adapter and warm-up live in an instance: without one they cannot be pre-loaded
            adapter_host=ArtifactCost(adapter_s / 2, adapter_bytes) if with_instance else None,
            adapter_device=ArtifactCost(adapter_s, adapter_bytes) if with_instance else None,
            warmup=ArtifactCost(load_s("warmup"), 0) if with_instance else None,
        )
        return FunctionProfile(name=FunctionName(spec.name), backbone=BackboneName(spec.backbone),
                               arrival_rate_per_s=0.0, costs=costs,
                               slo_ttft_s=spec.slo_ttft_ms / 1e3, kv_bytes_per_token=backbone.kv_bytes_per_token)

    def kv_bytes_per_token(self, spec: FunctionSpec) -> int:
        """K and V of every layer for one token, in the dtype the bound backbone computes in (its weights')."""
        return self.catalogue.backbone(spec.backbone).kv_bytes_per_token

    def request_bytes(self, spec: FunctionSpec, tokens: int) -> int:
        return tokens * self.kv_bytes_per_token(spec)

    @staticmethod
    def request_tokens(request: m.Generate) -> int:
        if request.prompt_token_ids is not None:
            return len(request.prompt_token_ids) + request.params.max_tokens
        text = request.prompt or "".join(msg.content for msg in request.messages or ())
        return len(text) // CHARS_PER_TOKEN + 32 + request.params.max_tokens  # + chat template overhead

    # -- acting ----------------------------------------------------------------------------------------------------

    async def make_room(self, spec: FunctionSpec, tokens: int, device: str) -> bool:
        """Before a batch runs on `device`: free its KV bytes there by offloading idle functions' artifacts.
        One decision at a time, each on a fresh view: concurrent requests must not evict the same things twice."""
        needed = self.request_bytes(spec, tokens)
        async with self._deciding:
            decision = self.scheduler.make_room(self.view(), DeviceId(device), needed)
            if decision.actions:
                reason = f"a batch of {spec.name} needed {needed} bytes; {decision.free_bytes} were free"
                log.info("%s: offloading %d artifact(s): %s", spec.name, len(decision.actions), reason)
                for action in decision.actions:
                    try:
                        await self.apply_offload(action, reason)
                    except (LorafaasError, OSError) as exc:  # e.g. that instance just exited: nothing to free there
                        log.warning("%s: offloading %s of %s failed: %s", spec.name, action.kind, action.function,
                                    exc)
        return decision.satisfied

    async def apply_plan(self, now_s: float) -> None:
        """The periodic pre-load plan's pre-loads, in loading order. Its offloads are not applied: an artifact
        leaves the device only when a batch needs its memory (`make_room`) or its instance's keep-alive ends, so idle
        memory is never emptied for nothing."""
        rated = self.scheduler.rated(self.view(), now_s)
        await asyncio.sleep(0)
        # the knapsack is pure and keeps no state: a fleet's (tens of ms) runs beside the event loop, not in it
        plan = await asyncio.to_thread(self.scheduler.preloader.plan, rated, now_s)
        self.scheduler.rates.mark_planned(now_s)
        for action in plan.preloads:
            await self.apply_preload(action)

    async def apply_offload(self, action: Offload, reason: str) -> None:
        state = self.functions.get(action.function)
        if state is None:
            return
        idle = [i for i in self.table.current(state.spec) if i.state == "ready" and not i.in_flight]
        if action.kind == "adapter":
            unstage: m.UnstageName = "adapter_offload" if action.to_tier == "host" else "adapter_drop"
            for instance in idle:
                if instance.client is not None:
                    await instance.client.unstage(unstage)
                instance.loaded.discard("adapter")
        elif action.kind == "warmup":
            for instance in idle:  # a warm-up holds no bytes of its own; forgetting it makes the next one run
                instance.loaded.discard("warmup")
        elif action.kind == "backbone":
            backbone = state.spec.backbone
            device = action.device or self.config.device_names[0]
            bound = [i for i in self.table.all() if i.backbone == backbone and i.device == device]
            if any(i.in_flight or i.state not in ("ready", "draining") for i in bound):
                return  # someone is using it after all (or an instance is starting or stopping): keep it
            for instance in bound:
                await self.instances.stop(instance, "its backbone was offloaded")
            await asyncio.to_thread(self.launcher.stop_daemon, backbone, device)
        else:
            return
        state.offloads.append(OffloadEvent(action.kind, action.from_tier, action.to_tier, time.time(), reason))

    async def apply_preload(self, action: Preload) -> None:
        state = self.functions.get(action.function)
        if state is None or action.kind == "libraries":
            return  # the pool and every instance hold the libraries already
        if action.kind == "backbone":
            await self.instances.prepare_backbone(state.spec.backbone, action.device)
            return
        instance = next((i for i in self.table.current(state.spec)
                         if i.instance_id == action.slot and i.state == "ready" and not i.in_flight), None)
        if instance is None:
            return
        stage: m.StageName = "adapter" if action.kind == "adapter" else "warmup"
        if stage not in instance.loaded and instance.client is not None:
            await instance.client.stage(stage)
            instance.loaded.add(stage)
