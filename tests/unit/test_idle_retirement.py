"""The node agent's keep-alive: a function idle as a whole retires its instances one per step, least recently used
first (`NodeAgent.retirements`, `KeepAlivePolicy.next_idle_retirement_s`), the simulator's `_on_idle_retire` the
same."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from lorafaas.platform.agent import AgentConfig, NodeAgent
from lorafaas.platform.agent.function_state import FunctionState
from lorafaas.platform.instance_table import Identity, Instance
from lorafaas.platform.state.records import FunctionSpec
from lorafaas.replay.sim.cluster import load_cluster
from lorafaas.replay.sim.engine import Simulator
from lorafaas.replay.sim.model import Expire, IdleRetire, SimInstance
from lorafaas.replay.sim.policies import POLICIES
from lorafaas.replay.workload import Request, Workload
from lorafaas.scheduler import FunctionName, SchedulerConfig

STEP_S = 180.0
# idle times of a bursty function: mostly seconds within a burst, a few hours-long gaps between bursts; on the
# paper's 4-hour histogram range it is representative and its window (the long tail, about 5,500 s) far beyond the step
BURSTY_IDLE_S = [10.0] * 20 + [5000.0] * 2
PAPER_RANGE_S = 4 * 3600.0


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _agent(spec: FunctionSpec, idle_times_s=BURSTY_IDLE_S) -> tuple[NodeAgent, Clock]:
    clock = Clock()
    config = AgentConfig(scheduler=SchedulerConfig(max_batch_size=8, idle_retire_step_s=STEP_S,
                                                   histogram_range_s=PAPER_RANGE_S))
    agent = NodeAgent(launcher=None, adapter_path=Path, config=config, clock=clock)  # type: ignore[arg-type]
    agent.functions[spec.name] = FunctionState(spec)
    for idle_s in idle_times_s:
        agent.scheduler.observe_idle(spec.name, idle_s)
    return agent, clock


def _spec(**fields) -> FunctionSpec:
    return FunctionSpec(name="fn", tenant="t", backbone="smollm2-135m", adapter_digest="0" * 64, max_instances=4,
                        created_at=0.0, updated_at=0.0, **fields)


def _ready(agent: NodeAgent, spec: FunctionSpec, instance_id: str, last_used_s: float) -> Instance:
    instance = agent.table.add(Instance(instance_id, Identity.of(spec), "cpu", started_s=0.0))
    instance.client = SimpleNamespace(connected=True)
    agent.table.transition(instance, "ready")
    instance.last_used_s = last_used_s
    return instance


def _stop(agent: NodeAgent, retired: list[tuple[Instance, str]]) -> list[str]:
    for instance, _ in retired:
        agent.table.transition(instance, "stopping")
        agent.table.transition(instance, "stopped")
    return [instance.instance_id for instance, _ in retired]


def test_an_idle_function_retires_its_least_recently_used_instance_one_step_at_a_time() -> None:
    spec = _spec()
    agent, clock = _agent(spec)
    assert agent.scheduler.keep_alive("fn").reason == "histogram"
    for k in range(3):
        _ready(agent, spec, f"i{k}", last_used_s=float(k))  # idle as a whole since 2.0
    clock.now_s = 2.0 + STEP_S - 1
    assert agent.retirements(spec) == []
    clock.now_s = 2.0 + STEP_S
    retired = agent.retirements(spec)
    assert "one instance per 180 s" in retired[0][1]
    assert _stop(agent, retired) == ["i0"]
    clock.now_s += STEP_S - 1
    assert agent.retirements(spec) == []  # the next one step after the last retirement, not after going idle
    clock.now_s += 1
    assert _stop(agent, agent.retirements(spec)) == ["i1"]
    clock.now_s += STEP_S
    assert _stop(agent, agent.retirements(spec)) == ["i2"]


def test_no_stepped_retirement_while_the_function_is_busy_below_min_instances_or_with_its_own_keep_alive() -> None:
    spec = _spec()
    agent, clock = _agent(spec)
    busy = _ready(agent, spec, "busy", last_used_s=0.0)
    _ready(agent, spec, "idle", last_used_s=0.0)
    busy.in_flight = 1  # one instance still serving: the function is not idle as a whole
    clock.now_s = 10 * STEP_S
    assert agent.retirements(spec) == []

    kept = _spec(min_instances=1)
    agent, clock = _agent(kept)
    _ready(agent, kept, "only", last_used_s=0.0)
    clock.now_s = 10 * STEP_S
    assert agent.retirements(kept) == []

    # no representative histogram: the window is the spec's own keep-alive, kept as set
    own = _spec(keep_alive_s=3600.0)
    agent, clock = _agent(own, idle_times_s=[])
    for k in range(2):
        _ready(agent, own, f"i{k}", last_used_s=0.0)
    clock.now_s = 10 * STEP_S
    assert agent.retirements(own) == []
    clock.now_s = 3600.0
    assert len(agent.retirements(own)) == 2  # past its keep-alive, as before


def test_the_simulator_retires_the_same_way() -> None:
    paper = load_cluster("paper")
    work = Workload((Request(0.0, "t", "llama2-7b-a", 10, 2),), 1.0)
    sim = Simulator(paper, POLICIES["lorafaas"], work)
    for idle_s in BURSTY_IDLE_S:  # its window comes from the histogram, as the stepped retirement needs
        sim.scheduler.observe_idle("llama2-7b-a", idle_s)
    fs = sim.fns["llama2-7b-a"]
    device = sim.mem.devices[0]
    for k in range(3):
        instance = SimInstance(f"i{k}", "llama2-7b-a", device, 0.0, 0.0, 0, last_used_s=float(k))
        fs.instances.append(instance)
        device.instances.add(instance)
    fs.last_end_s = 2.0
    sim.now = 2.0 + STEP_S
    sim.lifecycle.on_idle_retire(IdleRetire(FunctionName("llama2-7b-a"), 2.0))
    assert [i.instance_id for i in fs.instances] == ["i1", "i2"]
    at_s, _, event = sim.events[0]
    assert isinstance(event, IdleRetire)
    assert (at_s, event) == (2.0 + 2 * STEP_S, IdleRetire(FunctionName("llama2-7b-a"), 2.0))
    fs.last_end_s = 300.0  # it ran a batch since: the planned retirement is stale
    sim.now = at_s
    sim.lifecycle.on_idle_retire(event)
    assert [i.instance_id for i in fs.instances] == ["i1", "i2"]
    assert sim.scheduler.config.idle_retire_step_s == STEP_S  # the default the simulator runs with


def test_a_simulated_instance_that_never_gets_a_batch_still_idles_out() -> None:
    """Its requests went elsewhere while it started: it is retired a keep-alive window after it is ready, as the
    agent retires a ready instance idle since it was ready (it used to stay until the simulation ended)."""
    paper = load_cluster("paper")
    work = Workload((Request(0.0, "t", "llama2-7b-a", 10, 2),), 1.0)
    sim = Simulator(paper, POLICIES["lorafaas"], work)
    fs = sim.fns["llama2-7b-a"]
    instance = sim.lifecycle.cold_start("llama2-7b-a", fs, sim.mem.devices[0])
    window_s = sim.keep_alive_s("llama2-7b-a")
    expiries = [(at_s, event) for at_s, _, event in sim.events if isinstance(event, Expire)]
    assert expiries == [(instance.ready_at_s + window_s, Expire(instance, instance.expire_token))]
    sim.now = instance.ready_at_s + window_s
    sim.lifecycle.on_expire(expiries[0][1])
    assert fs.instances == []
