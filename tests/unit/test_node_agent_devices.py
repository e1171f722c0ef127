"""A node agent over two GPUs: each function's instances start on a device whose daemon serves its backbone, move to
the other device when that one's memory budget or compute is taken, and bind only the daemon on their own device.
Driven through the agent's own admission (`_acquire`) with a recording launcher in place of processes."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

from lorafaas.function_runtime.messages import WorkerSpec
from lorafaas.platform.agent import AgentConfig, NodeAgent
from lorafaas.platform.agent.function_state import FunctionState
from lorafaas.platform.descriptions import FailureView
from lorafaas.platform.devices import Device
from lorafaas.platform.state.records import FunctionSpec
from lorafaas.scheduler import SchedulerConfig

GIB = 1024**3
MIB = 1024**2
BACKBONE_BYTES = 1 * GIB
ADAPTER_BYTES = 32 * MIB
INSTANCE_BYTES = 64 * MIB  # agent.artifacts.INSTANCE_OVERHEAD_BYTES


class FakeWorker:
    connected = True

    def __init__(self) -> None:
        self.closed = asyncio.Event()

    async def stage(self, stage: str):
        return SimpleNamespace(seconds=0.0, adapter=None)

    async def wait_closed(self) -> None:
        await self.closed.wait()

    async def shutdown(self) -> None:
        self.closed.set()

    async def close(self) -> None:
        self.closed.set()


class FakeHandle:
    pid = None
    adopted = False

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec

    async def connect(self) -> FakeWorker:
        return FakeWorker()

    def alive(self) -> bool:
        return True

    def kill(self, sig: int = 15, timeout_s: float = 10.0) -> None:
        pass


class FakeStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def get(self, backbone: str):
        return SimpleNamespace(bytes=BACKBONE_BYTES, dtypes=("F32",))

    def path(self, backbone: str) -> Path:
        path = self.root / backbone
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text('{"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4}')
        return path


class RecordingLauncher:
    """GPUs whose daemons serve given backbones; records every worker spec it launches."""

    zygote_pid = None
    keeps_instances = False

    def __init__(self, root: Path, daemons: dict[str, set[str]]) -> None:
        self.store = FakeStore(root)
        self.daemons = daemons
        self.instances: list[FakeHandle] = []
        self.launched: list[WorkerSpec] = []

    def running_backbones(self, device: str | None = None) -> list[str]:
        return sorted(self.daemons[device or next(iter(self.daemons))])

    def daemon_socket(self, backbone: str, device: str | None = None) -> Path:
        device = device or next(iter(self.daemons))
        self.daemons[device].add(backbone)
        return Path(f"/run/{backbone}@{device}.sock")

    def stop_daemon(self, backbone: str, device: str | None = None) -> bool:
        self.daemons[device or next(iter(self.daemons))].discard(backbone)
        return True

    def spec(self, function, backbone, adapter_dir, *, shared=True, max_batch_size=8, num_threads=1,
             deployment=None, device=None) -> WorkerSpec:
        return WorkerSpec(function=function, instance_id=f"{function}-{len(self.launched)}",
                          socket_path="tcp://127.0.0.1:1", model_dir=str(self.store.path(backbone)),
                          daemon_socket=str(self.daemon_socket(backbone, device)), device=device or "cuda:0",
                          max_batch_size=max_batch_size)

    def launch(self, spec: WorkerSpec, **_) -> FakeHandle:
        self.launched.append(spec)
        handle = FakeHandle(spec)
        self.instances.append(handle)
        return handle

    def close(self) -> None:
        pass

    def describe_failures(self, function: str, since: float = 0.0) -> list[FailureView]:
        return []

    def forget_failures(self, function: str) -> None:
        pass


def _spec(name: str, backbone: str) -> FunctionSpec:
    return FunctionSpec(name=name, tenant="t", backbone=backbone, adapter_digest=name, max_instances=4,
                        created_at=0.0, updated_at=0.0)


def _agent(tmp_path: Path, budgets: dict[str, int], daemons: dict[str, set[str]], *specs: FunctionSpec
           ) -> tuple[NodeAgent, RecordingLauncher]:
    for spec in specs:  # each function's adapter, as big as ADAPTER_BYTES (sparse)
        (tmp_path / spec.adapter_digest).mkdir()
        with open(tmp_path / spec.adapter_digest / "adapter_model.safetensors", "wb") as f:
            f.truncate(ADAPTER_BYTES)
    launcher = RecordingLauncher(tmp_path / "models", daemons)
    config = AgentConfig(devices=tuple(Device(d, b) for d, b in budgets.items()), max_batch_size=8,
                         scheduler=SchedulerConfig(max_batch_size=8, preloading=False))
    agent = NodeAgent(launcher, lambda digest: tmp_path / digest, config, clock=lambda: 0.0)  # type: ignore[arg-type]
    agent.functions.update({spec.name: FunctionState(spec, agent.catalogue.adapter_bytes(spec.adapter_digest))
                            for spec in specs})
    return agent, launcher


def _bound_own_daemons(launcher: RecordingLauncher, agent: NodeAgent) -> None:
    for spec in launcher.launched:
        assert spec.daemon_socket.endswith(f"@{spec.device}.sock"), spec  # never a daemon on another device
    for instance in agent.table.all():
        assert instance.handle.spec.device == instance.device
        described = agent.describe(agent.functions[instance.function].spec).instances
        assert described[0].device == agent.table.of_function(instance.function)[0].device


def test_functions_start_on_the_device_whose_daemon_serves_their_backbone(tmp_path) -> None:
    a1, a2, b1 = _spec("a1", "bb-a"), _spec("a2", "bb-a"), _spec("b1", "bb-b")
    agent, launcher = _agent(tmp_path, {"cuda:0": 20 * GIB, "cuda:1": 20 * GIB},
                             {"cuda:0": {"bb-b"}, "cuda:1": {"bb-a"}}, a1, a2, b1)

    async def scenario():
        placed = {}
        for spec in (a1, b1, a2):
            instance, _size = await agent._acquire(spec, 1)
            placed[spec.name] = instance.device
        _bound_own_daemons(launcher, agent)
        await agent.stop()
        return placed

    assert asyncio.run(scenario()) == {"a1": "cuda:1", "a2": "cuda:1", "b1": "cuda:0"}
    assert launcher.daemons == {"cuda:0": {"bb-b"}, "cuda:1": {"bb-a"}}  # no daemon started twice


def test_a_device_whose_budget_is_full_sends_the_next_instance_to_the_other(tmp_path) -> None:
    a1, a2 = _spec("a1", "bb-a"), _spec("a2", "bb-a")
    # cuda:0 holds the backbone and one instance (its adapter and own memory), then is over its budget
    agent, launcher = _agent(tmp_path, {"cuda:0": BACKBONE_BYTES + INSTANCE_BYTES, "cuda:1": 20 * GIB},
                             {"cuda:0": {"bb-a"}, "cuda:1": set()}, a1, a2)

    async def scenario():
        first, _ = await agent._acquire(a1, 1)
        second, _ = await agent._acquire(a2, 1)
        _bound_own_daemons(launcher, agent)
        view = agent.planner.view()
        await agent.stop()
        return first.device, second.device, view

    first, second, view = asyncio.run(scenario())
    assert (first, second) == ("cuda:0", "cuda:1")
    assert launcher.daemons["cuda:1"] == {"bb-a"}  # its backbone's daemon started on the other GPU for it
    assert [(d.device_id, d.capacity_bytes) for d in view.devices] == [
        ("cuda:0", BACKBONE_BYTES + INSTANCE_BYTES), ("cuda:1", 20 * GIB)]
    assert {(r.function, r.kind, r.device) for r in view.resident if r.tier == "device"} >= {
        ("a1", "adapter", "cuda:0"), ("a2", "adapter", "cuda:1")}


def test_a_busy_device_scales_a_function_out_onto_the_other_with_busy_counted_per_device(tmp_path) -> None:
    a1 = _spec("a1", "bb-a")
    agent, launcher = _agent(tmp_path, {"cuda:0": 20 * GIB, "cuda:1": 20 * GIB},
                             {"cuda:0": {"bb-a"}, "cuda:1": set()}, a1)

    async def scenario():
        first, _ = await agent._acquire(a1, 1)
        first.in_flight = agent.config.max_batch_size  # its worker is full, and cuda:0 (one compute slot) busy
        assert (agent.table.busy_on_device("cuda:0"), agent.table.busy_on_device("cuda:1")) == (1, 0)
        options = agent.admission_view(a1, 1).start_options
        assert [(o.device, o.busy_instances, o.compute_slots) for o in options] == [("cuda:1", 0, 1)]
        second, _ = await agent._acquire(a1, 1)
        _bound_own_daemons(launcher, agent)
        busy = (agent.table.busy_on_device("cuda:0"), agent.table.busy_on_device("cuda:1"))
        first.in_flight = 0
        await agent.stop()
        return first.device, second.device, busy, agent.functions["a1"].last_admission.reason

    assert asyncio.run(scenario()) == ("cuda:0", "cuda:1", (1, 0), "scale_out")
