"""Pre-loading as a precedence-constrained knapsack (ServerlessLoRA), solved greedily by value density.

The model, per function f (arrival rate lambda_f) with backbone beta(f):

    artifact   tiers          value when pre-loaded in tier t         weight
    libraries  host           lambda_f * load_s(libraries)            bytes in f's worker slot
    backbone   host | device  lambda_f * load_s(backbone, t)          host: f's slot; device: the shared copy of
                                                                      beta(f), paid ONCE per device
    adapter    host | device  lambda_f * load_s(adapter, t)           bytes in f's slot or on the device
    warmup     device         lambda_f * load_s(warmup)               bytes on the device

Constraints: each artifact in at most one tier (moving up to the device releases the host bytes); the idle capacity
of every worker slot (all of f's host-side artifacts in one slot, one function per slot, a slot bound to a function
only for it) and of every device; precedence libraries -> {backbone, adapter} -> warmup; an adapter on a device only
where f's backbone is bound, warm-up only there too; functions being invoked keep what they have (pinned, counted as
used, never in an action).

`knapsack.GreedyKnapsack` solves it by value density over closures (an artifact with its missing prerequisites).
For views of at most `preload_seeded_max_functions` functions the greedy also runs seeded with each of the
`preload_seeds` most valuable closures and the best plan is kept, the classic guard against density shutting out one
large valuable item. `plan_difference` turns the target into actions from what is resident now.
"""

from __future__ import annotations

from dataclasses import dataclass

from lorafaas.scheduler.config import SchedulerConfig
from lorafaas.scheduler.knapsack import GreedyKnapsack
from lorafaas.scheduler.messages import ClusterView, Offload, Preload, Residency

UNLOAD_ORDER = {"warmup": 0, "adapter": 1, "backbone": 2, "libraries": 3}  # top of the precedence chain first


@dataclass(frozen=True)
class PreloadPlan:
    target: tuple[Residency, ...]  # what should be resident, in a valid loading order (pinned ones included)
    offloads: tuple[Offload, ...]  # from view.resident to target: unload first ...
    preloads: tuple[Preload, ...]  # ... then load
    value: float  # sum of lambda * load_s over the planned (not pinned) artifacts: expected load-seconds saved/s


class PreloadPlanner:
    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()

    def plan(self, view: ClusterView, now_s: float = 0.0) -> PreloadPlan:
        """The target residency for the node's idle capacity and the actions that reach it from `view.resident`.
        `now_s` is unused: rates come in the view (see `RateTracker.apply`)."""
        del now_s
        if not self.config.preloading:
            return PreloadPlan(target=(), offloads=(), preloads=(), value=0.0)
        horizon = self.config.device_preload_horizon_s
        solver = GreedyKnapsack(view, horizon)
        target = solver.solve()
        value = solver.value
        if len(solver.names) <= self.config.preload_seeded_max_functions:
            # density alone can shut out one large valuable closure (the knapsack's classic trap): also try each
            # of the most valuable closures first, and keep the best plan
            for first in GreedyKnapsack(view, horizon).most_valuable(self.config.preload_seeds):
                seeded = GreedyKnapsack(view, horizon)
                seeded_target = seeded.solve(first)
                if seeded.value > value * (1 + 1e-12):
                    target, value = seeded_target, seeded.value
        offloads, preloads = plan_difference(view.resident, target)
        return PreloadPlan(target=target, offloads=offloads, preloads=preloads, value=value)


def plan_difference(current: tuple[Residency, ...] | list[Residency],
                    target: tuple[Residency, ...] | list[Residency]) -> tuple[tuple[Offload, ...], tuple[Preload, ...]]:
    """Actions from `current` to `target`: offloads (warm-up first, libraries last), then preloads in `target`'s
    order. A device-tier artifact whose target is the host tier of the same slot is offloaded device -> host; a host
    copy whose artifact moves up to a device is consumed by that move (no separate offload)."""
    current_set, target_set = set(current), set(target)
    target_by_key = {(r.function, r.kind, r.tier): r for r in target}
    offloads: list[Offload] = []
    for r in current:
        if r in target_set:
            continue
        if r.tier == "host" and (r.function, r.kind, "device") in target_by_key \
                and target_by_key[(r.function, r.kind, "device")].slot == r.slot:
            continue  # moves up with the device preload
        down = target_by_key.get((r.function, r.kind, "host")) if r.tier == "device" else None
        keep_on_host = down is not None and down.slot == r.slot and down not in current_set
        offloads.append(Offload(r.function, r.kind, r.tier, "host" if keep_on_host else None, r.device, r.slot))
    offloads.sort(key=lambda o: (UNLOAD_ORDER[o.kind], o.from_tier != "device", o.function))
    moved_down = {(o.function, o.kind, o.slot) for o in offloads if o.to_tier == "host"}
    preloads = tuple(Preload(r.function, r.kind, r.tier, r.device, r.slot) for r in target
                     if r not in current_set and not (r.tier == "host" and (r.function, r.kind, r.slot) in moved_down))
    return tuple(offloads), preloads


