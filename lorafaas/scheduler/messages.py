"""The scheduler's data: frozen views in, frozen decisions out. Nothing here acts, reads a clock or touches a device.

The views describe one node as its agent sees it at an instant:

    ClusterView
    ├── functions: FunctionProfile per function (backbone, arrival rate, SLO, per-artifact ArtifactCosts)
    ├── devices:   DeviceView per device (capacity, bytes used by things that are not resident artifacts)
    ├── slots:     WorkerSlot per idle worker slot (host memory a function's host-side artifacts may use)
    ├── resident:  Residency per artifact loaded now (function, kind, tier, device or slot)
    ├── invoked:   functions serving requests now (their artifacts are pinned: never moved, never offloaded)
    └── instances: InstanceView per function instance (for placement)

Memory accounting: `DeviceView.used_bytes` and `WorkerSlot.used_bytes` are the bytes NOT attributable to the
resident artifacts listed in `resident` (KV caches, activations, process overhead). The policies add artifact bytes
themselves from the profiles, counting a shared backbone once per device.

Decisions: `Preload`, `Offload` (artifact actions, in the order to apply them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, NewType

FunctionName = NewType("FunctionName", str)
DeviceId = NewType("DeviceId", str)
InstanceId = NewType("InstanceId", str)
SlotId = NewType("SlotId", str)
BackboneName = NewType("BackboneName", str)

ArtifactKind = Literal["libraries", "backbone", "adapter", "warmup"]
Tier = Literal["host", "device"]  # loading order per function: libraries -> {backbone, adapter} -> warmup


@dataclass(frozen=True, slots=True)
class ArtifactCost:
    """What having one artifact pre-loaded in one tier is worth: the loading delay it removes from a cold start,
    and the memory it holds in that tier."""

    load_s: float
    memory_bytes: int

    def __post_init__(self) -> None:
        if self.load_s < 0 or self.memory_bytes < 0:
            raise ValueError(f"an artifact cost needs load_s >= 0 and memory_bytes >= 0, got {self}")


@dataclass(frozen=True, slots=True)
class ArtifactCosts:
    """One function's artifacts in the tiers each may live in: libraries on the host only, warm-up (CUDA kernels,
    allocator, thread pools) on the device only, backbone and adapter in either. `None`: cannot be pre-loaded there.

    `backbone_device.memory_bytes` is the shared copy's size: it is paid once per device whatever the number of
    functions bound to it; `backbone_host` is the function's own host-side copy in its worker slot."""

    libraries: ArtifactCost | None = None
    backbone_host: ArtifactCost | None = None
    backbone_device: ArtifactCost | None = None
    adapter_host: ArtifactCost | None = None
    adapter_device: ArtifactCost | None = None
    warmup: ArtifactCost | None = None

    def get(self, kind: ArtifactKind, tier: Tier) -> ArtifactCost | None:
        if kind == "libraries":
            return self.libraries if tier == "host" else None
        if kind == "warmup":
            return self.warmup if tier == "device" else None
        return getattr(self, f"{kind}_{tier}")


@dataclass(frozen=True)
class FunctionProfile:
    name: FunctionName
    backbone: BackboneName
    arrival_rate_per_s: float
    costs: ArtifactCosts
    slo_ttft_s: float = 1.0
    kv_bytes_per_token: int = 0  # KV cache plus activations one prompt token holds on the device

    def __post_init__(self) -> None:
        if self.arrival_rate_per_s < 0:
            raise ValueError(f"function {self.name}: arrival_rate_per_s is {self.arrival_rate_per_s}; must be >= 0")
        if self.slo_ttft_s <= 0:
            raise ValueError(f"function {self.name}: slo_ttft_s is {self.slo_ttft_s}; must be > 0")


@dataclass(frozen=True, slots=True)
class DeviceView:
    device_id: DeviceId
    capacity_bytes: int
    used_bytes: int = 0  # by everything except the resident artifacts (KV caches, activations, contexts)
    compute_slots: int = 1  # instances it runs at full speed at once (a GPU: 1; a CPU: cores / threads each)


@dataclass(frozen=True, slots=True)
class WorkerSlot:
    """Host memory one worker may hold a function's host-side artifacts in (libraries, host copies of backbone and
    adapter). An idle instance of a function is a slot bound to it; a free pool worker is a slot bound to none.
    The planner only fills the slots it is shown: it never asks for a new one."""

    slot_id: SlotId
    capacity_bytes: int
    used_bytes: int = 0
    function: FunctionName | None = None


class Residency(NamedTuple):
    """One artifact of one function, loaded now or in a target: host tier in `slot`, device tier on `device`.
    (Records and actions are NamedTuples: a plan makes thousands, and tuples hash and compare in C.)"""

    function: FunctionName
    kind: ArtifactKind
    tier: Tier
    device: DeviceId | None = None
    slot: SlotId | None = None


@dataclass(frozen=True, slots=True)
class InstanceView:
    instance_id: InstanceId
    function: FunctionName
    device: DeviceId
    loaded: frozenset[str] = frozenset()  # artifact kinds loaded in it
    num_running: int = 0
    max_running: int = 1

    @property
    def warm(self) -> bool:
        """Can take a request now: ready (libraries, backbone, adapter loaded) with room for one more."""
        return {"libraries", "backbone", "adapter"} <= self.loaded and self.num_running < self.max_running


@dataclass(frozen=True)
class ClusterView:
    functions: Mapping[FunctionName, FunctionProfile]
    devices: tuple[DeviceView, ...]
    slots: tuple[WorkerSlot, ...] = ()
    resident: tuple[Residency, ...] = ()
    invoked: frozenset[FunctionName] = frozenset()
    instances: tuple[InstanceView, ...] = ()


# -- decisions ----------------------------------------------------------------------------------------------------


class Preload(NamedTuple):
    """Load `kind` of `function` into `tier` (on `device` for the device tier) through its worker in `slot`.
    A device-tier artifact already held in the host tier moves up (the host copy is no longer planned)."""

    function: FunctionName
    kind: ArtifactKind
    tier: Tier
    device: DeviceId | None = None
    slot: SlotId | None = None


class Offload(NamedTuple):
    """Move `kind` of `function` out of `from_tier` (on `device` / in `slot`): to the host tier, or drop (None)."""

    function: FunctionName
    kind: ArtifactKind
    from_tier: Tier
    to_tier: Tier | None
    device: DeviceId | None = None
    slot: SlotId | None = None


@dataclass(frozen=True)
class Plan:
    """Everything one `Scheduler.plan` call decided, each tuple in the order to apply it."""

    offloads: tuple[Offload, ...] = ()
    preloads: tuple[Preload, ...] = ()
    target: tuple[Residency, ...] = field(default=(), repr=False)  # the pre-load target the actions lead to
