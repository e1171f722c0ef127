"""What the node agent's batching model learns from a request's first token: its own prefill's time and batch, and
nothing from a prefill run in the shared base pass, whose time is the round's (other functions' rows, their own
parts): taken as T(b), it had the agent bound a function in the pass at two requests an instance."""

from __future__ import annotations

from pathlib import Path

from lorafaas.function_runtime import messages as m
from lorafaas.platform.agent import AgentConfig, NodeAgent
from lorafaas.platform.agent.function_state import FunctionState
from lorafaas.platform.agent.observations import observe_prefill
from lorafaas.platform.state.records import FunctionSpec
from lorafaas.scheduler import SchedulerConfig


def agent_and_spec() -> tuple[NodeAgent, FunctionSpec]:
    config = AgentConfig(scheduler=SchedulerConfig())
    agent = NodeAgent(launcher=None, adapter_path=Path, config=config, clock=lambda: 0.0)  # type: ignore[arg-type]
    spec = FunctionSpec(name="fn", tenant="t", backbone="b", adapter_digest="0" * 64, created_at=0.0, updated_at=0.0)
    agent.functions[spec.name] = FunctionState(spec)
    return agent, spec


def observed(agent: NodeAgent, spec: FunctionSpec) -> int:
    return agent.scheduler.batch_policy(spec.name, spec.slo_ttft_ms / 1e3).model.num_observed


def test_a_prefill_on_its_own_cores_is_learned_and_one_in_the_shared_pass_is_not() -> None:
    agent, spec = agent_and_spec()
    own = m.Token(request_id="a", token_id=1, text="x", prefill_s=0.2, prefill_batch=2)
    observe_prefill(agent.scheduler, spec, 2, own, waited_s=0.3)
    assert observed(agent, spec) == 1
    in_pass = m.Token(request_id="b", token_id=1, text="x", prefill_s=1.4, prefill_batch=3, prefill_shared=True)
    observe_prefill(agent.scheduler, spec, 3, in_pass, waited_s=1.6)
    assert observed(agent, spec) == 1  # neither its time nor, in its place, the time it waited
