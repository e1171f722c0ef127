"""Keep-alive under a memory budget: which idle instances a node keeps when more of them wait than its memory holds.

Each idle instance is worth what keeping it saves: the chance its function is invoked within its keep-alive window
(a Poisson stream at the function's rate: 1 - exp(-rate x window)) times the cold start it then avoids. Kept by
value per byte of its private memory (the bytes its retirement frees: process, adapter, its own copies; a shared
backbone is not its own), densest first while the budget holds them; the rest retire, lowest value per byte first.
A function's second idle instance is worth less than its first: its value counts the chance of two invocations
within the window overlapping, approximated as the first's value times that chance again.

Greedy by density is the fractional knapsack's optimum and within one item of the 0/1 optimum; with thousands of
instances of a few hundred megabytes under a budget of gigabytes that item is small. O(n log n) in the instances.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lorafaas.scheduler.messages import FunctionName, InstanceId


@dataclass(frozen=True, slots=True)
class IdleInstance:
    instance_id: InstanceId
    function: FunctionName
    private_bytes: int  # freed when it retires
    rate_per_s: float  # its function's arrival rate
    cold_start_s: float  # what a start of its function costs when this instance is gone
    window_s: float  # its keep-alive window: how long keeping it could pay
    last_used_s: float = 0.0  # ties: the least recently used retires first

    def __post_init__(self) -> None:
        if self.private_bytes < 0 or self.rate_per_s < 0 or self.cold_start_s < 0 or self.window_s < 0:
            raise ValueError(f"an idle instance needs non-negative bytes, rate, cold start and window, got {self}")


@dataclass(frozen=True, slots=True)
class IdleBudgetDecision:
    keep: tuple[InstanceId, ...]
    retire: tuple[InstanceId, ...]  # lowest value per byte first
    kept_bytes: int
    budget_bytes: int


def expected_saving_s(rate_per_s: float, window_s: float, cold_start_s: float, rank: int = 0) -> float:
    """Seconds of cold start keeping an instance is expected to save: P(an invocation within the window) times the
    start it avoids; the function's `rank`-th idle instance (0: its first) counts that chance `rank + 1` times."""
    p = -math.expm1(-rate_per_s * window_s)
    return p ** (rank + 1) * cold_start_s


def keep_within_budget(instances: Iterable[IdleInstance], budget_bytes: int) -> IdleBudgetDecision:
    """Keep the idle instances of most expected saving per byte while their private bytes fit `budget_bytes`;
    retire the others, lowest value per byte first. A budget that holds all keeps all."""
    if budget_bytes < 0:
        raise ValueError(f"the idle-instance budget is {budget_bytes} bytes; it must be >= 0")
    items = list(instances)
    if sum(i.private_bytes for i in items) <= budget_bytes:
        return IdleBudgetDecision(tuple(i.instance_id for i in items), (), sum(i.private_bytes for i in items),
                                  budget_bytes)
    scored = _scored(items)
    scored.sort(key=lambda s: (-s[0], -s[1].last_used_s, s[1].instance_id))
    keep: list[InstanceId] = []
    dropped: list[tuple[float, IdleInstance]] = []
    kept_bytes = 0
    for density, inst in scored:
        if kept_bytes + inst.private_bytes <= budget_bytes:
            keep.append(inst.instance_id)
            kept_bytes += inst.private_bytes
        else:
            dropped.append((density, inst))
    dropped.sort(key=lambda s: (s[0], s[1].last_used_s, s[1].instance_id))
    return IdleBudgetDecision(tuple(keep), tuple(i.instance_id for _, i in dropped), kept_bytes, budget_bytes)


def _scored(items: Sequence[IdleInstance]) -> list[tuple[float, IdleInstance]]:
    """(value per byte, instance); a function's instances ranked most recently used first."""
    by_function: dict[FunctionName, list[IdleInstance]] = {}
    for inst in items:
        by_function.setdefault(inst.function, []).append(inst)
    scored = []
    for group in by_function.values():
        group.sort(key=lambda i: (-i.last_used_s, i.instance_id))
        for rank, inst in enumerate(group):
            saving = expected_saving_s(inst.rate_per_s, inst.window_s, inst.cold_start_s, rank)
            scored.append((saving / max(1, inst.private_bytes), inst))
    return scored
