"""When a function's idle instances retire: past the keep-alive window, or one step at a time while the function
is idle as a whole and its window comes from the idle-time histogram."""

from __future__ import annotations

from lorafaas.platform.agent.config import AgentConfig
from lorafaas.platform.agent.function_state import FunctionState
from lorafaas.platform.instance_table import Instance, InstanceTable
from lorafaas.platform.state.records import FunctionSpec
from lorafaas.scheduler import FunctionName, Scheduler


def retirements(state: FunctionState, table: InstanceTable, scheduler: Scheduler, config: AgentConfig,
                queued: int, now: float) -> list[tuple[Instance, str]]:
    """The idle instances to stop now, least recently used first, never below `min_instances`: those past the
    keep-alive window; else, while the function is idle as a whole (nothing `queued`) and its window comes from the
    idle-time histogram, one per `idle_retire_step_s` (`Scheduler.next_idle_retirement_s`; a stepped retirement
    returned is recorded as done in `state`). A keep-alive the function's spec sets is kept as set."""
    spec = state.spec
    window_s = keep_alive_s(spec, scheduler, config)
    current = table.current(spec)
    surplus = max(0, len(current) - spec.min_instances)
    idle = sorted((i for i in current if i.state == "ready" and i.in_flight == 0), key=lambda i: i.last_used_s)
    expired = [(i, f"idle for {now - i.last_used_s:.1f} s (keep-alive {window_s:.1f} s)")
               for i in idle if now - i.last_used_s >= window_s][:surplus]
    if expired or not surplus or len(idle) < len(current) or queued:
        return expired
    idle_since = max(i.last_used_s for i in idle)
    due = scheduler.next_idle_retirement_s(state.name, idle_since, state.idle_retired_s)
    if due is None or now < due:
        return []
    state.idle_retired_s = now
    return [(idle[0], f"function idle for {now - idle_since:.1f} s: one instance per "
                      f"{config.scheduler.idle_retire_step_s:.0f} s")]


def keep_alive_s(spec: FunctionSpec, scheduler: Scheduler, config: AgentConfig) -> float:
    """The function's own keep-alive, unless the hybrid policy has a representative idle-time histogram."""
    if config.scheduler.keep_alive_policy == "hybrid":
        decision = scheduler.keep_alive(FunctionName(spec.name))
        if decision.reason == "histogram":
            return decision.prewarm_s + decision.keep_alive_s
    return spec.keep_alive_s
