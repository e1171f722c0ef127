"""Dynamic offloading (ServerlessLoRA): free device memory for an arriving batch by evicting the least value-dense
artifacts of functions that are not being invoked.

    Q       = tokens of the batch * kv_bytes_per_token of its function (KV cache and activations)
    deficit = Q - free bytes of the device (free = capacity - used - resident artifacts, a backbone once)
    victims, least dense first (density = lambda_f * load_s(kind, device) / bytes), until the deficit is freed:
        warm-up of f                    dropped
        adapter of f (+ its warm-up)    moved to f's worker slot if it fits there (`offload_to_host`), else dropped
        backbone copy (+ every binding, adapter and warm-up on that device), only if none of its functions is
                                        invoked; dropped (the backbone daemon unloads it)

Nothing of an invoked function is touched. When even evicting every candidate would not free the deficit, nothing is
evicted and the decision says so (`satisfied=False`): scarcity is a value, not an exception.
"""

from __future__ import annotations

from dataclasses import dataclass

from lorafaas.scheduler.config import SchedulerConfig
from lorafaas.scheduler.messages import (
    ClusterView,
    DeviceId,
    FunctionName,
    FunctionProfile,
    Offload,
    SlotId,
    Tier,
)


@dataclass(frozen=True)
class OffloadDecision:
    satisfied: bool  # after `actions`, `needed_bytes` are free on the device
    actions: tuple[Offload, ...]  # in the order to apply them (empty when not satisfied)
    needed_bytes: int
    free_bytes: int  # free before any action
    freed_bytes: int  # what `actions` free
    freeable_bytes: int  # the most that evicting every candidate could free


def batch_memory_bytes(profile: FunctionProfile, num_tokens: int) -> int:
    """Q: the device bytes a batch holding `num_tokens` prompt and generated tokens needs (KV cache, activations)."""
    return max(0, num_tokens) * profile.kv_bytes_per_token


def device_free_bytes(view: ClusterView, device: DeviceId) -> int:
    """Capacity - used - the artifacts resident on it (a shared backbone once)."""
    return plan_offload(view, device, 0).free_bytes


def plan_offload(view: ClusterView, device: DeviceId, needed_bytes: int,
                 config: SchedulerConfig | None = None) -> OffloadDecision:
    config = config or SchedulerConfig()
    found = next((d for d in view.devices if d.device_id == device), None)
    if found is None:
        raise ValueError(f"device {device!r} is not in the view (devices: {[d.device_id for d in view.devices]})")

    # what is on the device per function, and which backbones invoked functions pin there
    on_device: dict[FunctionName, dict[str, int]] = {}  # function -> kind -> bytes
    slot_of: dict[FunctionName, SlotId] = {}
    pinned_backbones: set[str] = set()
    backbone_bytes: dict[str, int] = {}
    bindings: dict[str, list[FunctionName]] = {}
    held = 0
    functions, invoked = view.functions, view.invoked
    for r in view.resident:
        if r.device != device or r.tier != "device":
            continue
        profile = functions.get(r.function)
        if profile is None:
            continue
        cost = profile.costs.get(r.kind, "device")
        size = cost.memory_bytes if cost is not None else 0
        if r.kind == "backbone":
            if profile.backbone not in backbone_bytes:
                held += size
            backbone_bytes[profile.backbone] = max(size, backbone_bytes.get(profile.backbone, 0))
        else:
            held += size
        if r.function in invoked:
            if r.kind == "backbone":
                pinned_backbones.add(profile.backbone)
            continue
        on_device.setdefault(r.function, {})[r.kind] = size
        if r.slot is not None:
            slot_of[r.function] = r.slot
        if r.kind == "backbone":
            bindings.setdefault(profile.backbone, []).append(r.function)
    free = found.capacity_bytes - found.used_bytes - held
    deficit = needed_bytes - free
    if deficit <= 0:
        return OffloadDecision(True, (), needed_bytes, free, 0, 0)

    # victim groups, each (density, is a backbone, name, index, members as (function, kind, bytes), extra bytes)
    groups: list[tuple[float, bool, str, int, tuple[tuple[FunctionName, str, int], ...], int]] = []
    values: dict[tuple[FunctionName, str], float] = {}
    freeable = 0
    for f, kinds in on_device.items():
        profile = functions[f]
        rate, costs = profile.arrival_rate_per_s, profile.costs
        for kind, cost in (("warmup", costs.warmup), ("adapter", costs.adapter_device),
                           ("backbone", costs.backbone_device)):
            if kind in kinds:
                values[(f, kind)] = rate * cost.load_s if cost is not None else 0.0
        warm, adapter = kinds.get("warmup"), kinds.get("adapter")
        if warm is not None:
            freeable += warm
            if warm > 0:
                groups.append((values[(f, "warmup")] / warm, False, f, 0, ((f, "warmup", warm),), 0))
        if adapter is not None:
            freeable += adapter
            members = ((f, "warmup", warm), (f, "adapter", adapter)) if warm is not None else ((f, "adapter", adapter),)
            size = sum(m[2] for m in members)
            if size > 0:
                groups.append((sum(values[m[:2]] for m in members) / size, False, f, 1, members, 0))
    for backbone, users in bindings.items():
        if backbone in pinned_backbones:
            continue
        bound = [(f, kind, on_device[f][kind]) for f in sorted(users) for kind in ("warmup", "adapter", "backbone")
                 if kind in on_device[f]]
        size = backbone_bytes[backbone] + sum(m[2] for m in bound if m[1] != "backbone")
        freeable += backbone_bytes[backbone]
        if size > 0:
            value = sum(values[m[:2]] for m in bound)
            groups.append((value / size, True, backbone, 2, tuple(bound), backbone_bytes[backbone]))
    if not config.offloading or freeable < deficit:
        return OffloadDecision(False, (), needed_bytes, free, 0, freeable)

    groups.sort(key=lambda g: g[:4])
    evicted: set[tuple[FunctionName, str]] = set()
    chosen: list[tuple[FunctionName, str]] = []
    freed = 0
    for _, _, _, _, group_members, extra in groups:
        if freed >= deficit:
            break
        for f, kind, size in group_members:
            if (f, kind) not in evicted:
                evicted.add((f, kind))
                chosen.append((f, kind))
                freed += size if kind != "backbone" else 0
        freed += extra
    # adapters go to their worker slot's host memory when it has room for them
    room: dict[SlotId, int] = {}
    if config.offload_to_host:
        room = _slot_room(view, {slot_of[f] for f, kind in chosen if kind == "adapter" and f in slot_of})
    actions = []
    for f, kind in chosen:
        slot = slot_of.get(f)
        to_host: Tier | None = None
        if kind == "adapter" and slot in room:
            host_cost = functions[f].costs.adapter_host
            if host_cost is not None and room[slot] >= host_cost.memory_bytes:
                room[slot] -= host_cost.memory_bytes
                to_host = "host"
        actions.append(Offload(f, kind, "device", to_host, device, slot))  # type: ignore[arg-type]
    return OffloadDecision(True, tuple(actions), needed_bytes, free, freed, freeable)


def _slot_room(view: ClusterView, slots: set[SlotId]) -> dict[SlotId, int]:
    """Free bytes of each of `slots`: capacity - used - the host-tier artifacts resident in it."""
    if not slots:
        return {}
    room = {s.slot_id: s.capacity_bytes - s.used_bytes for s in view.slots if s.slot_id in slots}
    for r in view.resident:
        if r.slot in room and r.tier == "host":
            profile = view.functions.get(r.function)
            cost = profile.costs.get(r.kind, "host") if profile is not None else None
            room[r.slot] -= cost.memory_bytes if cost is not None else 0
    return room
