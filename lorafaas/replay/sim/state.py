"""The simulated cluster's memory: resident artifacts per function and device, instance bytes, GPU billing.

`Residency` records are the scheduler's own (`lorafaas.scheduler.Residency`), so the views the simulator hands the
policies are built straight from this state. A shared backbone copy is one set of bytes per (device, backbone name);
without sharing every function's backbone name is its own, so every function pays its own copy.

Billing integrates each device's billed bytes over time: bytes of functions running a batch on it (their artifacts,
instance overheads, KV caches, and a shared backbone copy that any running function is bound to) at the active
rate, everything else resident at the idle rate (kept-alive instances, pre-loaded artifacts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lorafaas.replay.sim.cluster import PriceSheet
from lorafaas.scheduler import DeviceId, FunctionName, Residency, SlotId


@dataclass(eq=False)  # identity: devices are kept in sets
class DeviceState:
    device_id: DeviceId
    node: int
    capacity_bytes: int
    used_bytes: int = 0  # instance overheads and KV caches (not resident artifacts)
    num_running: int = 0  # instances running a batch now (contention is between processes)
    # insertion-ordered (a dict, not a set): iteration order must not depend on string hashing (PYTHONHASHSEED)
    resident: dict[Residency, None] = field(default_factory=dict)
    billed_at_s: float = 0.0
    active_bytes: int = 0
    idle_bytes: int = 0
    cost: float = 0.0
    active_overhead: int = 0  # used_bytes of instances running a batch (KV included)
    instances: set = field(default_factory=set)  # the simulator's instances on this device
    decoding: dict = field(default_factory=dict)  # its instances with requests decoding, in the order they began
    artifact_bytes: int = 0  # bytes of `resident`, a shared backbone copy once (kept as residencies come and go)
    backbone_refs: dict[str, int] = field(default_factory=dict)  # backbone name -> residencies of it here


class MemoryState:
    """Resident artifacts, device memory and billing; `backbone_of[f]` is the backbone name used in views."""

    def __init__(
        self,
        devices: list[DeviceState],
        price: PriceSheet,
        backbone_of: dict[FunctionName, str],
        artifact_bytes: dict[tuple[FunctionName, str], int],
    ) -> None:
        self.devices = devices
        self.by_id = {d.device_id: d for d in devices}
        self.price = price
        self.backbone_of = backbone_of
        self.artifact_bytes = artifact_bytes  # (function, kind) -> device bytes
        self.of_function: dict[FunctionName, dict[Residency, None]] = {}  # insertion-ordered, as `resident`
        self.available_at: dict[Residency, float] = {}
        self.running_functions: dict[DeviceId, dict[FunctionName, int]] = {d.device_id: {} for d in devices}
        self.version = 0  # bumped by every add and remove (views cache what they derive from residencies)

    # -- residencies --------------------------------------------------------------------------------------------

    def add(self, r: Residency, available_at_s: float) -> None:
        self.version += 1
        self.of_function.setdefault(r.function, {})[r] = None
        self.available_at[r] = available_at_s
        if r.tier == "device" and r.device is not None:
            device = self.by_id[r.device]
            if r not in device.resident:
                device.resident[r] = None
                device.artifact_bytes += self._bytes_added(device, r, +1)

    def remove(self, r: Residency) -> None:
        self.version += 1
        rs = self.of_function.get(r.function)
        if rs is not None:
            rs.pop(r, None)
            if not rs:
                del self.of_function[r.function]
        self.available_at.pop(r, None)
        if r.tier == "device" and r.device is not None:
            device = self.by_id[r.device]
            if r in device.resident:
                del device.resident[r]
                device.artifact_bytes -= self._bytes_added(device, r, -1)

    def _bytes_added(self, device: DeviceState, r: Residency, step: int) -> int:
        """The bytes one residency adds (+1) or frees (-1): a backbone copy only with its first or last reference."""
        if r.kind != "backbone":
            return self.artifact_bytes[r.function, r.kind]
        name = self.backbone_of[r.function]
        before = device.backbone_refs.get(name, 0)
        after = before + step
        if after:
            device.backbone_refs[name] = after
        else:
            device.backbone_refs.pop(name, None)
        return self.artifact_bytes[r.function, r.kind] if (before == 0 or after == 0) else 0

    def find(self, function: FunctionName, kind: str, tier: str, device: DeviceId | None = None) -> Residency | None:
        for r in self.of_function.get(function, ()):
            if r.kind == kind and r.tier == tier and (device is None or r.device == device):
                return r
        return None

    def backbone_on(self, device: DeviceState, backbone: str) -> Residency | None:
        for r in device.resident:
            if r.kind == "backbone" and self.backbone_of[r.function] == backbone:
                return r
        return None

    def all_resident(self) -> tuple[Residency, ...]:
        return tuple(r for rs in self.of_function.values() for r in rs)

    # -- memory -------------------------------------------------------------------------------------------------

    def artifact_total(self, device: DeviceState) -> int:
        return device.artifact_bytes

    def artifact_total_recounted(self, device: DeviceState) -> int:
        """`artifact_total` from scratch (the index's check)."""
        total, copies = 0, set()
        for r in device.resident:
            if r.kind == "backbone":
                name = self.backbone_of[r.function]
                if name in copies:
                    continue
                copies.add(name)
            total += self.artifact_bytes[r.function, r.kind]
        return total

    def free_bytes(self, device: DeviceState) -> int:
        return device.capacity_bytes - device.used_bytes - self.artifact_total(device)

    # -- billing ------------------------------------------------------------------------------------------------

    def bill(self, device: DeviceState, now_s: float) -> None:
        """Integrate the device's cost up to now at its current rates, then recompute them."""
        dt = now_s - device.billed_at_s
        if dt > 0:
            device.cost += (
                dt
                * (
                    device.active_bytes * self.price.gpu_active_per_gb_s
                    + device.idle_bytes * self.price.gpu_idle_per_gb_s
                )
                / 1e9
            )
        device.billed_at_s = now_s
        active = self.active_artifact_bytes(device)
        device.active_bytes = active + device.active_overhead
        device.idle_bytes = device.artifact_bytes - active + device.used_bytes - device.active_overhead

    def active_artifact_bytes(self, device: DeviceState) -> int:
        """Resident bytes of the functions running a batch on `device`: their own artifacts here and each shared
        backbone copy one of them is bound to (O(running functions), not O(resident))."""
        running = self.running_functions[device.device_id]
        active, bound = 0, {}
        for f in running:
            bound[self.backbone_of[f]] = f
            for r in self.of_function.get(f, ()):
                if r.tier == "device" and r.device == device.device_id and r.kind != "backbone":
                    active += self.artifact_bytes[f, r.kind]
        for name, f in bound.items():
            if device.backbone_refs.get(name):
                active += self.artifact_bytes[f, "backbone"]
        return active

    def active_artifact_bytes_recounted(self, device: DeviceState) -> int:
        """`active_artifact_bytes` from every residency of the device (the check)."""
        running = self.running_functions[device.device_id]
        active_backbones = {self.backbone_of[f] for f in running}
        active, copies = 0, set()
        for r in device.resident:
            if r.kind == "backbone":
                name = self.backbone_of[r.function]
                if name in copies:
                    continue
                copies.add(name)
                is_active = name in active_backbones
            else:
                is_active = r.function in running
            if is_active:
                active += self.artifact_bytes[r.function, r.kind]
        return active

    def total_cost(self, now_s: float) -> float:
        for d in self.devices:
            self.bill(d, now_s)
        return sum(d.cost for d in self.devices)


def slot_of(function: FunctionName) -> SlotId:
    """The worker slot an instance of `function` brings (an idle instance is a slot bound to its function)."""
    return SlotId(f"i-{function}")
