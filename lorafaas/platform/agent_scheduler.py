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
import json
import logging
import time
from dataclasses import dataclass

from lorafaas.errors import AdapterNotFound, LorafaasError
from lorafaas.function_runtime import messages as m
from lorafaas.scheduler import (
    ArtifactCost,
    ArtifactCosts,
    ClusterView,
    DeviceView,
    FunctionProfile,
    InstanceView,
    Offload,
    Preload,
    Residency,
    WorkerSlot,
)

log = logging.getLogger(__name__)

# Defaults until measured on this node (seconds): what each artifact costs a cold start.
DEFAULT_LOAD_S = {"libraries": 4.0, "backbone": 5.0, "adapter": 0.01, "warmup": 0.2}
INSTANCE_OVERHEAD_BYTES = 64 * 1024**2  # a worker's own memory besides the artifacts (interpreter, heaps, buffers)
POOL_SLOT_BYTES = 1024**4  # host memory is the device's on the CPU: slots are not the binding constraint
CHARS_PER_TOKEN = 4  # the agent does not tokenize: a prompt's tokens are estimated from its length


@dataclass
class OffloadEvent:
    kind: str
    from_tier: str
    to_tier: str | None
    at: float  # unix time
    reason: str

    def describe(self) -> dict:
        return {"kind": self.kind, "from": self.from_tier, "to": self.to_tier or "dropped", "at": self.at,
                "reason": self.reason}


def compute_dtype_bytes(weight_dtypes: tuple[str, ...]) -> int:
    """Bytes of one element of the activations and KV cache of a backbone with weights of `weight_dtypes` (safetensors
    names): a 16-bit float where its matrices are (norms kept in float32 beside them do not change that), else 4."""
    return 2 if {"BF16", "F16"} & set(weight_dtypes) else 4


class AgentScheduler:
    """Builds views of the agent's state and applies plans; owned by the NodeAgent, used on its event loop."""

    def __init__(self, agent) -> None:
        self.agent = agent
        self.measured: dict[tuple[str, str], float] = {}  # (backbone or function, kind) -> seconds
        self.offloads: dict[str, list[OffloadEvent]] = {}
        self._kv_bytes: dict[str, int] = {}
        self._deciding = asyncio.Lock()  # one offloading decision (and its actions) at a time

    # -- observations ------------------------------------------------------------------------------------------

    def record_cold_start(self, spec, steps: dict[str, float]) -> None:
        for kind in ("backbone", "adapter", "warmup"):
            if kind in steps:
                self.measured[spec.name, kind] = steps[kind]

    def record_daemon_start(self, backbone: str, seconds: float) -> None:
        self.measured[backbone, "daemon"] = seconds

    # -- the view ------------------------------------------------------------------------------------------------

    def view(self) -> ClusterView:
        agent = self.agent
        names = agent.config.device_names
        functions, slots, resident = {}, [], []
        used = self._kv_bytes_by_device()  # bytes besides resident artifacts: KV caches, instances' own
        running_backbones = {d: set(agent.launcher.running_backbones(d)) for d in names}
        invoked = frozenset(i.function for i in agent.table.all() if i.in_flight)
        instances = tuple(InstanceView(i.instance_id, i.function, i.device, frozenset(i.loaded), i.in_flight,
                                       agent.config.max_batch_size) for i in agent.table.all() if i.state == "ready")
        for name, spec in agent.specs.items():
            pool = [i for i in agent.table.current(spec) if i.state == "ready"]
            functions[name] = self.profile(spec, with_instance=bool(pool))
            fn_slots = [f"{i.instance_id}" for i in pool] or [f"pool:{name}"]
            for instance in pool:
                slots.append(WorkerSlot(instance.instance_id, POOL_SLOT_BYTES, function=name))
                used[instance.device] += INSTANCE_OVERHEAD_BYTES
                resident.append(Residency(name, "libraries", "host", slot=instance.instance_id))
                loaded = set(instance.loaded)
                if "adapter" in loaded:
                    resident.append(Residency(name, "adapter", "device", instance.device, instance.instance_id))
                if "warmup" in loaded:
                    resident.append(Residency(name, "warmup", "device", instance.device, instance.instance_id))
            if not pool:
                slots.append(WorkerSlot(fn_slots[0], POOL_SLOT_BYTES, function=name))
                if agent.launcher.zygote_pid is not None:
                    resident.append(Residency(name, "libraries", "host", slot=fn_slots[0]))
            for device in names:
                if spec.backbone in running_backbones[device]:
                    resident.append(Residency(name, "backbone", "device", device, fn_slots[0]))
        devices = tuple(DeviceView(d.name, d.budget_bytes, used[d.name]) for d in agent.config.devices)
        return ClusterView(functions=functions, devices=devices, slots=tuple(slots), resident=tuple(resident),
                           invoked=invoked, instances=instances)

    def _kv_bytes_by_device(self) -> dict[str, int]:
        """The KV bytes of the requests running, on the devices of the instances that hold them (a function's
        estimate split by their requests)."""
        agent = self.agent
        kv = dict.fromkeys(agent.config.device_names, 0)
        for name, spec in agent.specs.items():
            holders = [i for i in agent.table.of_function(name) if i.in_flight]
            total = sum(i.in_flight for i in holders)
            for instance in holders:
                share = agent.in_flight_tokens.get(name, 0) * instance.in_flight // total
                kv[instance.device] = kv.get(instance.device, 0) + self.request_bytes(spec, share)
        return kv

    def profile(self, spec, with_instance: bool) -> FunctionProfile:
        store = self.agent.launcher.store
        backbone_bytes = store.get(spec.backbone).bytes
        try:
            adapter_bytes = _adapter_bytes(self.agent.adapter_path(spec.adapter_digest))
        except (AdapterNotFound, FileNotFoundError):  # deleted or replaced while this view was built (the store
            adapter_bytes = 0  # drops the adapter before the agent drops the spec): never another request's error

        def load_s(kind: str) -> float:
            return self.measured.get((spec.name, kind), DEFAULT_LOAD_S[kind])

        backbone_s = self.measured.get((spec.backbone, "daemon"), DEFAULT_LOAD_S["backbone"]) + load_s("backbone")
        costs = ArtifactCosts(
            libraries=ArtifactCost(self.agent.library_import_s or DEFAULT_LOAD_S["libraries"], 0),
            backbone_device=ArtifactCost(backbone_s, backbone_bytes),
            # adapter and warm-up live in an instance: without one they cannot be pre-loaded
            adapter_host=ArtifactCost(load_s("adapter") / 2, adapter_bytes) if with_instance else None,
            adapter_device=ArtifactCost(load_s("adapter"), adapter_bytes) if with_instance else None,
            warmup=ArtifactCost(load_s("warmup"), 0) if with_instance else None,
        )
        return FunctionProfile(name=spec.name, backbone=spec.backbone, arrival_rate_per_s=0.0, costs=costs,
                               slo_ttft_s=spec.slo_ttft_ms / 1e3, kv_bytes_per_token=self.kv_bytes_per_token(spec))

    def kv_bytes_per_token(self, spec) -> int:
        """K and V of every layer for one token, in the dtype the bound backbone computes in (its weights')."""
        if spec.backbone not in self._kv_bytes:
            store = self.agent.launcher.store
            config = json.loads((store.path(spec.backbone) / "config.json").read_text())
            heads = config.get("num_attention_heads", 1)
            head_dim = config.get("head_dim") or config.get("hidden_size", 0) // heads
            kv_heads = config.get("num_key_value_heads") or heads
            element = compute_dtype_bytes(store.get(spec.backbone).dtypes)
            self._kv_bytes[spec.backbone] = 2 * config.get("num_hidden_layers", 1) * kv_heads * head_dim * element
        return self._kv_bytes[spec.backbone]

    def request_bytes(self, spec, tokens: int) -> int:
        return tokens * self.kv_bytes_per_token(spec)

    @staticmethod
    def request_tokens(request: m.Generate) -> int:
        if request.prompt_token_ids is not None:
            return len(request.prompt_token_ids) + request.params.max_tokens
        text = request.prompt or "".join(msg.content for msg in request.messages or ())
        return len(text) // CHARS_PER_TOKEN + 32 + request.params.max_tokens  # + chat template overhead

    # -- acting ----------------------------------------------------------------------------------------------------

    async def make_room(self, spec, tokens: int, device: str) -> bool:
        """Before a batch runs on `device`: free its KV bytes there by offloading idle functions' artifacts.
        One decision at a time, each on a fresh view: concurrent requests must not evict the same things twice."""
        needed = self.request_bytes(spec, tokens)
        async with self._deciding:
            decision = self.agent.scheduler.make_room(self.view(), device, needed)
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
        plan = self.agent.scheduler.plan(self.view(), now_s)
        for action in plan.preloads:
            await self.apply_preload(action)

    async def apply_offload(self, action: Offload, reason: str) -> None:
        agent = self.agent
        idle = [i for i in agent.table.of_function(action.function) if i.state == "ready" and not i.in_flight]
        if action.kind == "adapter":
            stage = "adapter_offload" if action.to_tier == "host" else "adapter_drop"
            for instance in idle:
                await instance.client.unstage(stage)
                instance.loaded.discard("adapter")
        elif action.kind == "warmup":
            for instance in idle:  # a warm-up holds no bytes of its own; forgetting it makes the next one run
                instance.loaded.discard("warmup")
        elif action.kind == "backbone":
            spec = agent.specs.get(action.function)
            if spec is None:
                return
            device = action.device or agent.config.device_names[0]
            bound = [i for i in agent.table.all() if i.backbone == spec.backbone and i.device == device]
            if any(i.in_flight or i.state not in ("ready", "draining") for i in bound):
                return  # someone is using it after all (or an instance is starting or stopping): keep it
            for instance in bound:
                await agent.stop_instance(instance, "its backbone was offloaded")
            await asyncio.to_thread(agent.launcher.stop_daemon, spec.backbone, device)
        else:
            return
        self.offloads.setdefault(action.function, []).append(
            OffloadEvent(action.kind, action.from_tier, action.to_tier, time.time(), reason))

    async def apply_preload(self, action: Preload) -> None:
        agent = self.agent
        spec = agent.specs.get(action.function)
        if spec is None or action.kind == "libraries":
            return  # the pool and every instance hold the libraries already
        if action.kind == "backbone":
            await agent.prepare_backbone(spec.backbone, action.device)
            return
        instance = next((i for i in agent.table.of_function(action.function)
                         if i.instance_id == action.slot and i.state == "ready" and not i.in_flight), None)
        if instance is None:
            return
        stage = {"adapter": "adapter", "warmup": "warmup"}[action.kind]
        if stage not in instance.loaded:
            await instance.client.stage(stage)
            instance.loaded.add(stage)

    def describe(self, name: str) -> list[dict]:
        return [event.describe() for event in self.offloads.get(name, [])]


def _adapter_bytes(adapter_dir) -> int:
    return (adapter_dir / "adapter_model.safetensors").stat().st_size
