"""Placement of a request (or a new instance) of one function, best class first:

    1 "warm"       a warm instance of the function (ready, with room), least busy first
    2 "preloaded"  an instance of the function holding the most pre-loaded artifacts, then on the least busy device
    3 "backbone"   a device where the function's backbone is resident (its binding is free), least busy first
    4 "cold"       any device, least busy first

"Least busy": fewest running requests (on the instance for class 1, on the device otherwise), then the larger
fraction of free memory. Classes 3 and 4 only consider devices where the function's adapter (and the backbone, if
absent) fits, unless none does. Among the candidates of the best class that tie on its first key (class 2: the
number of artifacts), one of the `placement_top_k` least busy is drawn from the injected RNG, so a burst spreads over
near-equal devices instead of piling onto the first.

Load-aware sharing: a device whose compute is taken by other functions (as many of their instances hold requests as
it has `compute_slots`) is "contended": work sent there time-slices the device with them. Classes 1-3 on a contended
device rank after classes 1-3 on a free one (a busy copy of the backbone only when no free device holds one), and
before class 4 (a bind to a busy copy serves its first token seconds before a load elsewhere; admission then starts
a spare instance where compute is free, `admission._spare_device`). Class 4 on a contended device comes last.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from lorafaas.scheduler.config import SchedulerConfig
from lorafaas.scheduler.messages import ClusterView, DeviceId, FunctionName, InstanceId

PlacementKind = Literal["warm", "preloaded", "backbone", "cold"]
_CLASS: dict[str, int] = {"warm": 0, "preloaded": 1, "backbone": 2, "cold": 6}
# the classes on a contended device (module docstring): after the same classes on a free one
_CONTENDED: dict[str, int] = {"warm": 3, "preloaded": 4, "backbone": 5, "cold": 7}


@dataclass(frozen=True, slots=True)
class PlacementCandidate:
    kind: PlacementKind
    device: DeviceId
    instance_id: InstanceId | None
    num_artifacts: int
    num_running: int
    free_fraction: float
    contended: bool = False  # other functions' busy instances fill the device's compute slots

    @property
    def group_key(self) -> tuple[int, int]:
        if self.contended:
            return _CONTENDED[self.kind], -self.num_artifacts
        return _CLASS[self.kind], -self.num_artifacts

    @property
    def sort_key(self) -> tuple[int, int, int, float, str, str]:
        return (*self.group_key, self.num_running, -self.free_fraction, self.device, self.instance_id or "")


@dataclass(frozen=True, slots=True)
class PlacementDecision:
    kind: PlacementKind
    device: DeviceId
    instance_id: InstanceId | None  # the instance to use (warm, preloaded); None: start one on `device`


class PlacementPolicy:
    def __init__(self, config: SchedulerConfig | None = None, rng: random.Random | None = None) -> None:
        self.config = config or SchedulerConfig()
        self.rng = rng if rng is not None else random.Random(0)

    def rank(self, function: FunctionName, view: ClusterView) -> list[PlacementCandidate]:
        """Every candidate, best first (deterministic)."""
        profile = view.functions.get(function)
        running = {d.device_id: 0 for d in view.devices}
        for inst in view.instances:
            running[inst.device] = running.get(inst.device, 0) + inst.num_running
        free, backbones_on = _device_memory(view)
        capacity = {d.device_id: max(1, d.capacity_bytes) for d in view.devices}
        contended = _contended_devices(function, view)

        def free_fraction(device: DeviceId) -> float:
            return free.get(device, 0) / capacity.get(device, 1)

        out: list[PlacementCandidate] = []
        for inst in view.instances:
            if inst.function != function:
                continue
            if inst.warm:
                out.append(PlacementCandidate("warm", inst.device, inst.instance_id, len(inst.loaded),
                                              inst.num_running, free_fraction(inst.device), inst.device in contended))
            elif inst.loaded and inst.num_running < inst.max_running:
                out.append(PlacementCandidate("preloaded", inst.device, inst.instance_id, len(inst.loaded),
                                              running.get(inst.device, 0), free_fraction(inst.device),
                                              inst.device in contended))
        backbone = profile.backbone if profile is not None else None
        adapter = profile.costs.adapter_device if profile is not None else None
        adapter_bytes = adapter.memory_bytes if adapter is not None else 0
        backbone_cost = profile.costs.backbone_device if profile is not None else None
        backbone_bytes = backbone_cost.memory_bytes if backbone_cost is not None else 0
        fresh: list[tuple[PlacementCandidate, bool]] = []
        for d in view.devices:
            has_backbone = backbone is not None and backbone in backbones_on.get(d.device_id, ())
            need = adapter_bytes + (0 if has_backbone else backbone_bytes)
            candidate = PlacementCandidate("backbone" if has_backbone else "cold", d.device_id, None, 0,
                                           running.get(d.device_id, 0), free_fraction(d.device_id),
                                           d.device_id in contended)
            fresh.append((candidate, free.get(d.device_id, 0) >= need))
        fitting = [c for c, fits in fresh if fits]
        out.extend(fitting if fitting else [c for c, _ in fresh])
        out.sort(key=lambda c: c.sort_key)
        return out

    def place(self, function: FunctionName, view: ClusterView) -> PlacementDecision | None:
        """The chosen candidate, or None when the view has no device at all."""
        ranked = self.rank(function, view)
        if not ranked:
            return None
        best = ranked[0].group_key
        ties = [c for c in ranked[: self.config.placement_top_k] if c.group_key == best]
        chosen = ties[0] if len(ties) == 1 else self.rng.choice(ties)
        return PlacementDecision(chosen.kind, chosen.device, chosen.instance_id)


def may_scale_out(num_instances: int, busy_on_device: int, compute_slots: int) -> bool:
    """Whether a function whose instances are all full (B requests each) should start another on this device.

    Its first instance always may. Another one only helps while the device has compute to spare: `busy_on_device`
    counts the device's instances (of every function) running or starting, `compute_slots` how many can run at full
    speed at once (a CPU: cores / threads per instance). On a saturated device a new instance does not add capacity;
    it slows every running batch, and since prefills then take longer, the batch policy's B shrinks and more
    instances follow. The request waits in its function's queue for a place in a running batch instead.
    """
    if compute_slots < 1:
        raise ValueError(f"compute_slots is {compute_slots}; must be >= 1")
    return num_instances == 0 or busy_on_device < compute_slots


def start_beats_joining(start_s: float | None, slo_ttft_s: float) -> bool:
    """Whether a function whose instances are all full should start another rather than let the request join a
    running batch that still has room in its worker (`in_flight_limit`).

    A start that alone outlasts the TTFT SLO (a backbone to load onto the device, say, rather than a 50 ms bind to the
    copy already there) serves its first requests later than a running batch would: they join it instead, and the
    instance starts only when no running batch has room. `start_s` is the expected start (None: not known yet, so
    the start is tried).
    """
    if not slo_ttft_s > 0:
        raise ValueError(f"slo_ttft_s is {slo_ttft_s}; must be > 0")
    return start_s is None or start_s <= slo_ttft_s


def _contended_devices(function: FunctionName, view: ClusterView) -> set[DeviceId]:
    """The devices where other functions' instances holding requests fill every compute slot."""
    busy: dict[DeviceId, int] = {}
    for inst in view.instances:
        if inst.function != function and inst.num_running > 0:
            busy[inst.device] = busy.get(inst.device, 0) + 1
    return {d.device_id for d in view.devices if busy.get(d.device_id, 0) >= max(1, d.compute_slots)}


def _device_memory(view: ClusterView) -> tuple[dict[DeviceId, int], dict[DeviceId, set[str]]]:
    """Free bytes per device (capacity - used - resident artifacts, a backbone once) and the backbones on each."""
    free = {d.device_id: d.capacity_bytes - d.used_bytes for d in view.devices}
    backbones_on: dict[DeviceId, set[str]] = {d.device_id: set() for d in view.devices}
    for r in view.resident:
        if r.tier != "device" or r.device not in free:
            continue
        profile = view.functions.get(r.function)
        if profile is None:
            continue
        if r.kind == "backbone":
            if profile.backbone in backbones_on[r.device]:
                continue
            backbones_on[r.device].add(profile.backbone)
        cost = profile.costs.get(r.kind, "device")
        free[r.device] -= cost.memory_bytes if cost is not None else 0
    return free, backbones_on
