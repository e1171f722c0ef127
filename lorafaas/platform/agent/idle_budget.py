"""Keep-alive under the node's memory budget: the idle instances beyond `AgentConfig.idle_budget_bytes` retire,
lowest expected saving per byte first, as the scheduler's `keep_within_budget` decides (the simulator's
`InstanceLifecycle.keep_within_budget` asks it the same way).

An idle instance is priced by its private memory (the worker's own `INSTANCE_OVERHEAD_BYTES` and the adapter it
holds: what its retirement frees; the backbone is shared), its function's arrival rate, the cold start it spares (the
measured start that made it) and what is left of its keep-alive window. A function's `min_instances` are never
candidates; their bytes count against the budget first. Rank-blind (`SchedulerConfig.rank_aware=False`, `up
--rank-blind`), every adapter is priced at the mean of the deployed functions' adapters.
"""

from __future__ import annotations

from lorafaas.platform.agent.artifacts import INSTANCE_OVERHEAD_BYTES, adapter_prices
from lorafaas.platform.agent.config import AgentConfig
from lorafaas.platform.agent.function_state import FunctionState
from lorafaas.platform.agent.retirement import keep_alive_s
from lorafaas.platform.instance_table import Instance, InstanceTable
from lorafaas.scheduler import FunctionName, IdleInstance, InstanceId, Scheduler, keep_within_budget


def budget_retirements(functions: dict[str, FunctionState], table: InstanceTable, scheduler: Scheduler,
                       config: AgentConfig, now: float) -> list[tuple[Instance, str]]:
    """The idle instances to stop so that those kept fit the node's idle budget (none without a budget)."""
    budget = config.idle_budget_bytes
    if budget is None:
        return []
    price = adapter_prices(functions.values(), config.scheduler.rank_aware)
    candidates: dict[InstanceId, Instance] = {}
    priced: list[IdleInstance] = []
    for state in functions.values():
        spec = state.spec
        current = table.current(spec)
        if not current:  # most of a fleet: nothing held, nothing to retire
            continue
        idle = sorted((i for i in current if i.state == "ready" and i.in_flight == 0),
                      key=lambda i: i.last_used_s, reverse=True)
        adapter_bytes, adapter_s = price(state)
        private = INSTANCE_OVERHEAD_BYTES + adapter_bytes
        held = max(0, min(len(idle), spec.min_instances - (len(current) - len(idle))))
        budget -= held * private  # the function's floor stays, and takes its share first
        rate = scheduler.rates.rate(FunctionName(spec.name), now) or config.scheduler.rate_floor_per_s
        window_s = keep_alive_s(spec, scheduler, config)
        for instance in idle[held:]:
            start_s = sum(v for k, v in instance.cold_start.items() if k != "total") or adapter_s
            candidates[InstanceId(instance.instance_id)] = instance
            priced.append(IdleInstance(InstanceId(instance.instance_id), FunctionName(spec.name), private, rate,
                                       start_s, max(0.0, instance.last_used_s + window_s - now), instance.last_used_s))
    decision = keep_within_budget(priced, max(0, budget))
    return [(candidates[i], f"idle instances over the node's budget of {config.idle_budget_bytes} bytes: lowest "
                            "expected saving per byte") for i in decision.retire]
