"""What `describe` shows of one function's life on this node, from its record alone."""

from __future__ import annotations

from lorafaas.platform.agent.config import AgentConfig
from lorafaas.platform.agent.function_state import FunctionState
from lorafaas.platform.descriptions import AdmissionView, BatchingView, FailureView, FunctionDescription
from lorafaas.platform.instance_table import InstanceTable
from lorafaas.scheduler import Scheduler


def describe_function(state: FunctionState, table: InstanceTable, scheduler: Scheduler, config: AgentConfig,
                      queued: int, backend_failures: list[FailureView]) -> FunctionDescription:
    """Its spec, instances, last cold start, offloads, batching decision (B and the fitted prefill model T(b) = T0 +
    a(b-1) it comes from), admission (the policy's last word and why requests waited), cold starts by kind and
    failures: the agent's and what the backend saw (`backend_failures`: a pod that could not be scheduled, pull its
    image or stay alive)."""
    spec = state.spec
    policy = scheduler.batch_policy(state.name, spec.slo_ttft_ms / 1e3)
    decision = state.last_admission
    return FunctionDescription(
        function=spec,
        instances=[i.describe() for i in table.of_function(spec.name) if state.owns(i.identity.uid)],
        last_cold_start=state.last_cold_start,
        registration=state.registration,
        offloaded=[event.describe() for event in state.offloads],
        batching=BatchingView(max_batch_size=min(policy.max_batch_size, config.max_batch_size),
                              prefill_t0_s=round(float(policy.model.t0_s), 4),
                              prefill_per_request_s=round(float(policy.model.a_s), 4),
                              prefills_observed=policy.model.num_observed, most_in_flight=state.most_in_flight),
        admission=AdmissionView(queued=queued, last_decision=decision.action if decision else None,
                                reason=decision.reason if decision else None, waits=dict(state.waits)),
        cold_starts=dict(state.cold_starts),
        failures=[*(f.describe() for f in state.failures), *backend_failures],
    )
