"""Small builders for hand-made scheduler views (sizes in plain units, delays in seconds)."""

from __future__ import annotations

from collections.abc import Iterable

from lorafaas.scheduler.messages import (
    ArtifactCost,
    ArtifactCosts,
    BackboneName,
    ClusterView,
    DeviceId,
    DeviceView,
    FunctionName,
    FunctionProfile,
    InstanceView,
    Residency,
    SlotId,
    WorkerSlot,
)

Pair = tuple[float, int] | None
DEFAULTS: dict[str, Pair] = {"libraries": (2.0, 1), "backbone_host": (1.0, 10), "backbone_device": (3.0, 10),
                             "adapter_host": (0.2, 1), "adapter_device": (0.5, 1), "warmup": (1.5, 1)}


def costs(**overrides: Pair) -> ArtifactCosts:
    pairs = {**DEFAULTS, **overrides}
    return ArtifactCosts(**{k: ArtifactCost(*v) if v is not None else None for k, v in pairs.items()})


def fn(name: str, backbone: str = "b", rate: float = 1.0, slo_s: float = 1.0, kv_bytes_per_token: int = 0,
       **overrides: Pair) -> FunctionProfile:
    return FunctionProfile(FunctionName(name), BackboneName(backbone), rate, costs(**overrides), slo_s,
                           kv_bytes_per_token)


def view(functions: Iterable[FunctionProfile], devices: Iterable[tuple[str, int, int]] = (("d0", 100, 0),),
         slots: Iterable[tuple[str, int, int, str | None]] | None = None, resident: Iterable[Residency] = (),
         invoked: Iterable[str] = (), instances: Iterable[InstanceView] = ()) -> ClusterView:
    functions = list(functions)
    if slots is None:  # one roomy open slot per function
        slots = [(f"s{k}", 100, 0, None) for k in range(len(functions))]
    return ClusterView(
        functions={p.name: p for p in functions},
        devices=tuple(DeviceView(DeviceId(d), c, u) for d, c, u in devices),
        slots=tuple(WorkerSlot(SlotId(s), c, u, FunctionName(f) if f else None) for s, c, u, f in slots),
        resident=tuple(resident),
        invoked=frozenset(FunctionName(f) for f in invoked),
        instances=tuple(instances),
    )


def res(function: str, kind: str, tier: str, device: str | None = None, slot: str | None = "s0") -> Residency:
    return Residency(FunctionName(function), kind, tier, DeviceId(device) if device else None,  # type: ignore[arg-type]
                     SlotId(slot) if slot else None)


def kinds_of(target: Iterable[Residency], function: str) -> dict[str, tuple[str, str | None]]:
    """kind -> (tier, device) of one function in a target."""
    return {r.kind: (r.tier, r.device) for r in target if r.function == function}
