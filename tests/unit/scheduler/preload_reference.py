"""Test-only references for the pre-load knapsack: an independent checker of every constraint, the value of a
target, an exact solver (depth-first search with bounds) for small instances, and a random small-instance maker.

Written from the model's statement in `lorafaas/scheduler/preload.py`, not from its code.
"""

from __future__ import annotations

import random
from collections import defaultdict

from lorafaas.scheduler.messages import (
    ArtifactCost,
    ArtifactCosts,
    BackboneName,
    ClusterView,
    DeviceId,
    DeviceView,
    FunctionName,
    FunctionProfile,
    Residency,
    SlotId,
    WorkerSlot,
)


def _cost(view: ClusterView, r: Residency) -> ArtifactCost:
    cost = view.functions[r.function].costs.get(r.kind, r.tier)
    assert cost is not None, f"{r} is planned in a tier it has no cost for"
    return cost


def check_target(view: ClusterView, target: tuple[Residency, ...]) -> None:
    """Raise AssertionError naming the first constraint `target` breaks."""
    pinned = [r for r in view.resident if r.function in view.invoked]
    planned = [r for r in target if r.function not in view.invoked]
    assert sorted(map(repr, (r for r in target if r.function in view.invoked))) == sorted(map(repr, pinned)), \
        "an invoked function's residency changed"
    by_fn: dict[str, dict[str, Residency]] = defaultdict(dict)
    for r in planned:
        assert r.function in view.functions, f"{r.function} is not a function of the view"
        assert (r.kind, r.tier) in {("libraries", "host"), ("backbone", "host"), ("backbone", "device"),
                                    ("adapter", "host"), ("adapter", "device"), ("warmup", "device")}, r
        assert r.kind not in by_fn[r.function], f"{r.function}/{r.kind} planned twice"
        by_fn[r.function][r.kind] = r
        assert (r.tier == "device") == (r.device is not None), r
        assert r.slot is not None, f"{r} has no worker slot"
    slot_owner: dict[str, str] = {}
    for r in pinned:
        if r.slot is not None:
            slot_owner[r.slot] = r.function
    bound = {s.slot_id: s.function for s in view.slots}
    for f, kinds in by_fn.items():
        # precedence libraries -> backbone/adapter -> warmup; adapter and warm-up where the backbone is bound
        assert "libraries" in kinds, f"{f}: {sorted(kinds)} without libraries"
        if "warmup" in kinds:
            assert kinds.get("adapter") is not None and kinds["adapter"].tier == "device", f"{f}: warm-up, no adapter"
        for kind in ("adapter", "warmup"):
            r = kinds.get(kind)
            if r is not None and r.tier == "device":
                bb = kinds.get("backbone")
                assert bb is not None and bb.tier == "device" and bb.device == r.device, \
                    f"{f}: {kind} on {r.device} but its backbone is bound to {bb}"
        slots = {r.slot for r in kinds.values()}
        assert len(slots) == 1, f"{f} spread over slots {slots}"
        slot = slots.pop()
        assert slot in bound, f"{f}: unknown slot {slot}"
        assert bound[slot] in (None, f), f"{f} uses slot {slot} bound to {bound[slot]}"
        assert slot_owner.setdefault(slot, f) == f, f"slot {slot} holds {f} and {slot_owner[slot]}"
    # capacities: slots, devices (a backbone once per device)
    slot_bytes: dict[str, int] = defaultdict(int)
    dev_bytes: dict[str, int] = defaultdict(int)
    backbones: set[tuple[str, str]] = set()
    for r in (*pinned, *planned):
        size = _cost(view, r).memory_bytes
        if r.tier == "host":
            slot_bytes[r.slot] += size  # type: ignore[index]
        elif r.kind == "backbone":
            key = (view.functions[r.function].backbone, r.device)
            if key not in backbones:
                backbones.add(key)  # type: ignore[arg-type]
                dev_bytes[r.device] += max(p.costs.backbone_device.memory_bytes for p in view.functions.values()
                                           if p.backbone == key[0] and p.costs.backbone_device is not None)
        else:
            dev_bytes[r.device] += size  # type: ignore[index]
    for s in view.slots:
        assert slot_bytes[s.slot_id] <= s.capacity_bytes - s.used_bytes, f"slot {s.slot_id} over capacity"
    for d in view.devices:
        assert dev_bytes[d.device_id] <= d.capacity_bytes - d.used_bytes, f"device {d.device_id} over capacity"


def target_value(view: ClusterView, target: tuple[Residency, ...]) -> float:
    return sum(view.functions[r.function].arrival_rate_per_s * _cost(view, r).load_s
               for r in target if r.function not in view.invoked)


def exact_value(view: ClusterView, lower_bound: float = 0.0) -> float:
    """The optimum's value (see `exact_target`)."""
    return exact_target(view, lower_bound)[0]


def exact_target(view: ClusterView, lower_bound: float = 0.0) -> tuple[float, tuple[Residency, ...] | None]:
    """The optimum by depth-first search over (function state, slot) with capacity and bound pruning: its value
    and a target reaching it (None when nothing beats `lower_bound`)."""
    fns = [f for f in sorted(view.functions) if f not in view.invoked]
    devices = [d.device_id for d in view.devices]
    dev_free = {d.device_id: d.capacity_bytes - d.used_bytes for d in view.devices}
    slot_free = {s.slot_id: s.capacity_bytes - s.used_bytes for s in view.slots}
    bb_size = {}
    for p in view.functions.values():
        if p.costs.backbone_device is not None:
            bb_size[p.backbone] = max(bb_size.get(p.backbone, 0), p.costs.backbone_device.memory_bytes)
    refs: dict[tuple[str, str], int] = defaultdict(int)
    taken: set[str] = set()
    for r in view.resident:
        if r.function not in view.invoked:
            continue
        if r.slot is not None:
            taken.add(r.slot)
        size = _cost(view, r).memory_bytes
        if r.tier == "host":
            slot_free[r.slot] -= size  # type: ignore[index]
        elif r.kind == "backbone":
            key = (view.functions[r.function].backbone, r.device)
            if refs[key] == 0:  # type: ignore[index]
                dev_free[r.device] -= bb_size[key[0]]  # type: ignore[index]
            refs[key] += 1  # type: ignore[index]
        else:
            dev_free[r.device] -= size  # type: ignore[index]

    def options(f: str) -> list[tuple[float, int, str | None, int, bool, tuple[tuple[str, str], ...]]]:
        """(value, host bytes, device, device bytes without the backbone, binds the backbone, (kind, tier)s)."""
        p = view.functions[f]
        c, rate = p.costs, p.arrival_rate_per_s
        if c.libraries is None:
            return []
        out = []
        lib_v, lib_w = rate * c.libraries.load_s, c.libraries.memory_bytes
        host_choices: list[tuple[float, int, str, str]] = [(0.0, 0, "none", "none")]
        for bb in ("none", "host"):
            for ad in ("none", "host"):
                if (bb == "host" and c.backbone_host is None) or (ad == "host" and c.adapter_host is None):
                    continue
                v = (rate * c.backbone_host.load_s if bb == "host" else 0) + \
                    (rate * c.adapter_host.load_s if ad == "host" else 0)
                w = (c.backbone_host.memory_bytes if bb == "host" else 0) + \
                    (c.adapter_host.memory_bytes if ad == "host" else 0)
                if (bb, ad) != ("none", "none"):
                    host_choices.append((v, w, bb, ad))
        for v, w, bb, ad in host_choices:
            host_kinds = ((k, "host") for k, t in (("backbone", bb), ("adapter", ad)) if t != "none")
            kinds = (("libraries", "host"), *host_kinds)
            out.append((lib_v + v, lib_w + w, None, 0, False, kinds))
        if c.backbone_device is not None:
            for d in devices:
                bb_v = rate * c.backbone_device.load_s
                base = (("libraries", "host"), ("backbone", "device"))
                device_states = [(0.0, 0, 0, base)]  # (value, host bytes, device bytes, kinds)
                if c.adapter_host is not None:
                    device_states.append((rate * c.adapter_host.load_s, c.adapter_host.memory_bytes, 0,
                                          (*base, ("adapter", "host"))))
                if c.adapter_device is not None:
                    device_states.append((rate * c.adapter_device.load_s, 0, c.adapter_device.memory_bytes,
                                          (*base, ("adapter", "device"))))
                    if c.warmup is not None:
                        device_states.append((rate * (c.adapter_device.load_s + c.warmup.load_s), 0,
                                              c.adapter_device.memory_bytes + c.warmup.memory_bytes,
                                              (*base, ("adapter", "device"), ("warmup", "device"))))
                for v, hw, dw, kinds in device_states:
                    out.append((lib_v + bb_v + v, lib_w + hw, d, dw, True, kinds))
        return out

    per_fn = {f: options(f) for f in fns}
    best_of = {f: max((o[0] for o in per_fn[f]), default=0.0) for f in fns}
    order = sorted(fns, key=lambda f: -best_of[f])
    remaining = [sum(best_of[f] for f in order[k:]) for k in range(len(order) + 1)]
    best = [lower_bound * (1 - 1e-9)]
    chosen: list[tuple[str, str, str | None, tuple[tuple[str, str], ...]]] = []
    best_choice: list[tuple[str, str, str | None, tuple[tuple[str, str], ...]] | None] = [None]

    def eligible_slots(f: str) -> list[str]:
        seen: set[tuple[int, str | None]] = set()
        out = []
        for s in view.slots:
            if s.slot_id in taken or s.function not in (None, f):
                continue
            key = (slot_free[s.slot_id], s.function)  # identical open slots are interchangeable
            if key in seen:
                continue
            seen.add(key)
            out.append(s.slot_id)
        return out

    def dfs(k: int, value: float) -> None:
        if value > best[0]:
            best[0] = value
            best_choice[0] = list(chosen)  # type: ignore[assignment]
        if k == len(order) or value + remaining[k] <= best[0]:
            return
        f = order[k]
        backbone = view.functions[f].backbone
        for v, hw, d, dw, binds, kinds in per_fn[f]:
            for s in eligible_slots(f):
                if slot_free[s] < hw:
                    continue
                extra = 0
                if binds:
                    extra = dw + (bb_size[backbone] if refs[(backbone, d)] == 0 else 0)  # type: ignore[index]
                    if dev_free[d] < extra:  # type: ignore[index]
                        continue
                    dev_free[d] -= extra  # type: ignore[index]
                    refs[(backbone, d)] += 1  # type: ignore[index]
                slot_free[s] -= hw
                taken.add(s)
                chosen.append((f, s, d, kinds))
                dfs(k + 1, value + v)
                chosen.pop()
                taken.discard(s)
                slot_free[s] += hw
                if binds:
                    refs[(backbone, d)] -= 1  # type: ignore[index]
                    dev_free[d] += extra  # type: ignore[index]
        dfs(k + 1, value)  # nothing for f

    dfs(0, 0.0)
    target = [r for r in view.resident if r.function in view.invoked]
    if best_choice[0] is None:
        return (best[0], None) if lower_bound > 0 else (0.0, tuple(target))
    for f, s, d, kinds in best_choice[0]:  # type: ignore[union-attr]
        target += [Residency(FunctionName(f), kind, tier, DeviceId(d) if tier == "device" else None,  # type: ignore
                             SlotId(s)) for kind, tier in kinds]
    return best[0], tuple(target)


def random_instance(rng: random.Random) -> ClusterView:
    """2-4 functions on 1-2 backbones, 1-2 devices, 1-3 slots; capacities that bind; sometimes a missing tier,
    a slot bound to a function, or an invoked function holding artifacts."""
    num_fns, num_devs, num_slots = rng.randint(2, 4), rng.randint(1, 2), rng.randint(1, 3)
    backbones = [(BackboneName(f"b{k}"), rng.randint(4, 12)) for k in range(rng.randint(1, 2))]
    functions = {}
    for n in range(num_fns):
        name = FunctionName(f"f{n}")
        backbone, size = rng.choice(backbones)

        def cost(load: tuple[float, float], mem: tuple[int, int], p_missing: float = 0.0) -> ArtifactCost | None:
            if rng.random() < p_missing:
                return None
            return ArtifactCost(round(rng.uniform(*load), 2), rng.randint(*mem))

        adapter = rng.randint(1, 3)
        functions[name] = FunctionProfile(name, backbone, round(rng.uniform(0.1, 3.0), 2), ArtifactCosts(
            libraries=cost((0.5, 3.0), (1, 4)),
            backbone_host=cost((0.5, 2.0), (size, size), 0.3),
            backbone_device=ArtifactCost(round(rng.uniform(1.0, 4.0), 2), size),
            adapter_host=ArtifactCost(round(rng.uniform(0.05, 0.5), 2), adapter),
            adapter_device=cost((0.3, 1.0), (adapter, adapter), 0.1),
            warmup=cost((0.2, 3.0), (1, 4), 0.2),
        ))
    devices = tuple(DeviceView(DeviceId(f"d{k}"), rng.randint(6, 24), rng.randint(0, 3)) for k in range(num_devs))
    names = sorted(functions)
    slots = tuple(WorkerSlot(SlotId(f"s{k}"), rng.randint(2, 14), rng.randint(0, 1),
                             rng.choice(names) if rng.random() < 0.2 else None) for k in range(num_slots))
    resident: tuple[Residency, ...] = ()
    invoked: frozenset[FunctionName] = frozenset()
    if rng.random() < 0.25:  # one function busy with its libraries, backbone and adapter on device 0
        f = names[-1]
        free_slots = [s.slot_id for s in slots if s.function in (None, f)]
        if free_slots:
            slot = free_slots[0]
            resident = (Residency(f, "libraries", "host", None, slot),
                        Residency(f, "backbone", "device", devices[0].device_id, slot))
            invoked = frozenset({f})
            check = ClusterView(functions, devices, slots, resident, invoked)
            try:
                check_target(check, resident)
            except AssertionError:
                resident, invoked = (), frozenset()
    return ClusterView(functions=functions, devices=devices, slots=slots, resident=resident, invoked=invoked)
