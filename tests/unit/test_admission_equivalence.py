"""The node agent and the simulator make the same admission decision in the same situation.

Both describe a function's queue through one builder (`lorafaas.scheduler.build_admission_view`) and carry out
`lorafaas.scheduler.decide_admission`; what could still differ is what each hands the builder (which instances count,
which are ready, how busy the device is, what B is, the settings). Each scenario of the shared table is set up in both
executors' own state, and the two views and decisions must agree.
"""

from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from lorafaas.platform.agent import AgentConfig, NodeAgent
from lorafaas.platform.agent.admission_view import admission_settings
from lorafaas.platform.agent.function_state import FunctionState
from lorafaas.platform.instance_table import Identity, Instance
from lorafaas.platform.state.records import FunctionSpec
from lorafaas.replay.sim.cluster import load_cluster
from lorafaas.replay.sim.engine import Simulator
from lorafaas.replay.sim.model import SimInstance
from lorafaas.replay.sim.policies import POLICIES
from lorafaas.replay.workload import Request, Workload
from lorafaas.scheduler import AdmissionDecision, SchedulerConfig, decide_admission

NOW_S = 100.0
SLO_S = 1.0
FULL = load_cluster("local").max_batch_size  # requests a worker holds at its capacity (the local cluster's, 32)


@dataclass(frozen=True)
class Scenario:
    name: str
    instances: tuple[tuple[bool, int], ...]  # (ready, requests in flight) of the function's instances
    queued: int
    busy_elsewhere: int = 0  # instances of another function running on the device
    slots: int = 2
    max_instances: int = 4
    prefills: tuple[tuple[int, float], ...] = ()  # (batch size, seconds) observed: they set B
    other_waits: bool = False  # the other function waits for a core (strict compute), since before
    strict: bool = False  # strict compute (the agent's --strict-compute, the cluster's device.strict_compute)


SCENARIOS = [
    Scenario("cold function", (), queued=1),
    Scenario("room in a ready instance", ((True, 2),), queued=3),
    Scenario("the least loaded of two", ((True, 5), (True, 1)), queued=9),
    Scenario("full, compute to spare: scale out", ((True, FULL),), queued=1),
    Scenario("full, device saturated by another function", ((True, FULL),), queued=2, busy_elsewhere=1),
    Scenario("B reached, device saturated: join", ((True, 2),), queued=4, busy_elsewhere=1,
             prefills=((1, 0.3), (2, 0.8))),
    Scenario("B reached, compute to spare: scale out", ((True, 2),), queued=4, prefills=((1, 0.3), (2, 0.8))),
    Scenario("only a starting instance", ((False, 0),), queued=3, max_instances=1),
    Scenario("at max instances, all full", ((True, FULL), (True, FULL)), queued=1, max_instances=2),
    Scenario("starting beside a full one", ((True, FULL), (False, 0)), queued=2, busy_elsewhere=0, slots=1),
    Scenario("four cores, three busy", ((True, FULL), (True, FULL)), queued=5, busy_elsewhere=1, slots=4),
    Scenario("an idle second instance, the cores taken", ((True, FULL), (True, 0)), queued=3, busy_elsewhere=1,
             max_instances=2),
    Scenario("an idle second instance, a core spare", ((True, 2), (True, 0)), queued=3, slots=3),
    Scenario("the function's one instance, the cores taken", ((True, 0),), queued=1, busy_elsewhere=2),
    Scenario("strictly, the function's one instance, the cores taken", ((True, 0),), queued=1, busy_elsewhere=2,
             strict=True),
    Scenario("strictly, a first instance, the cores taken", (), queued=1, busy_elsewhere=2, strict=True),
    Scenario("another function waits for a core: the running instance yields", ((True, 2),), queued=2,
             busy_elsewhere=1, other_waits=True, strict=True),
    Scenario("another function waited first: a core spare, but not its turn", ((True, 0),), queued=1,
             other_waits=True, strict=True),
    Scenario("another function waits, the cores taken: no start either", (), queued=1, busy_elsewhere=2,
             other_waits=True, strict=True),
]
WAITED_S = NOW_S - 0.2  # when the other function began waiting


def _spec(name: str, max_instances: int) -> FunctionSpec:
    return FunctionSpec(name=name, tenant="t", backbone="smollm2-135m", adapter_digest="0" * 64,
                        slo_ttft_ms=int(SLO_S * 1000), max_instances=max_instances, created_at=0.0, updated_at=0.0)


def agent_view(s: Scenario, expected_start_s: float | None):
    config = AgentConfig(max_batch_size=FULL, compute_slots=s.slots, strict_compute=s.strict,
                         scheduler=SchedulerConfig(max_batch_size=FULL))
    agent = NodeAgent(launcher=None, adapter_path=Path, config=config, clock=lambda: NOW_S)  # type: ignore[arg-type]
    spec, other = _spec("fn", s.max_instances), _spec("other", 4)
    agent.functions.update({"fn": FunctionState(spec), "other": FunctionState(other)})
    for k, (ready, in_flight) in enumerate(s.instances):
        _add(agent, spec, f"i{k}", ready, in_flight, started_s=float(k))
    for k in range(s.busy_elsewhere):
        _add(agent, other, f"o{k}", True, 1, started_s=0.0)
    for size, seconds in s.prefills:
        agent.scheduler.observe_prefill("fn", SLO_S, size, seconds)
    if expected_start_s is not None:
        agent.functions["fn"].last_scale_out_s = expected_start_s
    if s.other_waits:
        agent.compute_turns.note(Identity.of(other), AdmissionDecision("wait", "no_compute"), WAITED_S)
    return agent.admission_view(spec, s.queued)


def _add(agent: NodeAgent, spec: FunctionSpec, instance_id: str, ready: bool, in_flight: int, started_s: float):
    instance = agent.table.add(Instance(instance_id, Identity.of(spec), "cpu", started_s=started_s))
    if ready:
        instance.client = SimpleNamespace(connected=True)  # a worker connection, as far as admission looks
        agent.table.transition(instance, "ready")
    instance.in_flight = in_flight


def sim_view(s: Scenario):
    cluster = replace(load_cluster("local"), compute_slots=s.slots, max_instances_per_function=s.max_instances,
                      strict_compute=s.strict)
    work = Workload((Request(0.0, "t", "fn", 10, 2), Request(0.0, "t", "other", 10, 2)), 1.0)
    sim = Simulator(cluster, POLICIES["lorafaas"], work)
    sim.now = NOW_S
    fs = sim.fns["fn"]
    fs.spec = replace(fs.spec, slo_ttft_s=SLO_S)
    device = sim.mem.devices[0]
    for k, (ready, in_flight) in enumerate(s.instances):
        _sim_add(sim, "fn", f"i{k}", device, ready, in_flight, started_s=float(k))
    for k in range(s.busy_elsewhere):
        _sim_add(sim, "other", f"o{k}", device, True, 1, started_s=0.0)
    for size, seconds in s.prefills:
        sim.scheduler.observe_prefill("fn", SLO_S, size, seconds)
    if s.other_waits:
        sim.admission.turns.note("other", AdmissionDecision("wait", "no_compute"), WAITED_S)
    return sim.admission.view("fn", fs, s.queued)


def _sim_add(sim: Simulator, function: str, instance_id: str, device, ready: bool, in_flight: int, started_s: float):
    cold_s = 1.0
    ready_at_s = started_s + cold_s if ready else NOW_S + 5.0
    instance = SimInstance(instance_id, function, device, ready_at_s, ready_at_s - started_s, 0, num_seqs=in_flight,
                           running=1 if in_flight else 0)
    sim.fns[function].instances.append(instance)
    device.instances.add(instance)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_the_agent_and_the_simulator_decide_alike(scenario: Scenario) -> None:
    simulated = sim_view(scenario)
    expected_start = next((o.expected_start_s for o in simulated.start_options), None)
    live = agent_view(scenario, expected_start)
    # the same description, but for the device's name
    strip = lambda v: replace(v, start_options=tuple(replace(o, device="d") for o in v.start_options))  # noqa: E731
    assert strip(live) == strip(simulated)
    a, b = decide_admission(live), decide_admission(simulated)
    assert (a.action, a.reason, a.instance_id, a.size) == (b.action, b.reason, b.instance_id, b.size)
    assert (a.device is None) == (b.device is None)


def test_the_table_covers_every_kind_of_decision() -> None:
    seen = {decide_admission(sim_view(s)).action for s in SCENARIOS}
    reasons = {decide_admission(sim_view(s)).reason for s in SCENARIOS}
    assert seen == {"dispatch", "start", "await_start", "wait"}
    assert {"room", "join", "first_instance", "scale_out", "cold_start", "max_instances", "no_compute",
            "yield"} <= reasons


@pytest.mark.parametrize("strict", [False, True])
def test_both_executors_hand_the_shared_builder_the_same_settings(strict: bool) -> None:
    """The agent and the simulator describe a function through `lorafaas.scheduler.build_admission_view`; what they
    add of their own is its settings (from the agent's config, from the cluster and the policy), and those agree."""
    config = AgentConfig(max_batch_size=FULL, strict_compute=strict, scheduler=SchedulerConfig(max_batch_size=FULL))
    cluster = replace(load_cluster("local"), strict_compute=strict)
    sim = Simulator(cluster, POLICIES["lorafaas"], Workload((Request(0.0, "t", "fn", 10, 2),), 1.0))
    assert admission_settings(config) == sim.admission.settings
    assert admission_settings(config).strict_compute is strict
