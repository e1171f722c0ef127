"""A controller stopping over a backend whose instances outlive it (pods) leaves them running, and the next one adopts
them before serving with no cold start: the node agent's side of an upgrade on Kubernetes, driven with the recording
launcher of test_node_agent_devices.py in place of pods."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
from test_node_agent_devices import FakeHandle, FakeWorker, RecordingLauncher, _spec

from lorafaas.function_runtime.messages import WorkerSpec
from lorafaas.platform.agent import AgentConfig, NodeAgent
from lorafaas.platform.agent.function_state import FunctionState
from lorafaas.platform.devices import Device
from lorafaas.platform.state.records import FunctionSpec
from lorafaas.scheduler import SchedulerConfig


class Worker(FakeWorker):
    def __init__(self) -> None:
        super().__init__()
        self.shut_down = False

    async def shutdown(self) -> None:
        self.shut_down = True
        await super().shutdown()


class Pod(FakeHandle):
    def __init__(self, spec: WorkerSpec, adopted: bool) -> None:
        super().__init__(spec)
        self.adopted = adopted
        self.worker = Worker()
        self.killed = False

    async def connect(self) -> Worker:
        return self.worker

    def kill(self, sig: int = 15, timeout_s: float = 10.0) -> None:
        self.killed = True


class PodLauncher(RecordingLauncher):
    """Instances outlive it; `left` are the specs a previous controller left running (claimed by equal launches)."""

    keeps_instances = True

    def __init__(self, root: Path, daemons: dict[str, set[str]]) -> None:
        super().__init__(root, daemons)
        self.left: list[WorkerSpec] = []

    def spec(self, function, backbone, adapter_dir, *, deployment=None, **kwargs) -> WorkerSpec:
        return msgspec.structs.replace(super().spec(function, backbone, adapter_dir, **kwargs),
                                       adapter_dir=str(adapter_dir), deployment=deployment)

    def adoptable(self) -> list[WorkerSpec]:
        return list(self.left)

    def launch(self, spec: WorkerSpec, **_) -> Pod:
        theirs = next((s for s in self.left if s.function == spec.function), None)
        if theirs is not None:
            self.left.remove(theirs)
        pod = Pod(theirs or spec, adopted=theirs is not None)
        self.launched.append(spec)
        self.instances.append(pod)
        return pod


def _pod_agent(tmp_path: Path, spec: FunctionSpec) -> tuple[NodeAgent, PodLauncher]:
    (tmp_path / spec.adapter_digest).mkdir(parents=True, exist_ok=True)  # the home both controllers share
    launcher = PodLauncher(tmp_path / "models", {"cuda:0": {"bb"}})
    config = AgentConfig(devices=(Device("cuda:0", 20 * 1024**3),), max_batch_size=8,
                         scheduler=SchedulerConfig(max_batch_size=8, preloading=False))
    agent = NodeAgent(launcher, lambda digest: tmp_path / digest, config, clock=lambda: 0.0)  # type: ignore[arg-type]
    agent.functions[spec.name] = FunctionState(spec)
    return agent, launcher


def test_a_stopping_agent_leaves_pods_running_and_the_next_adopts_them_with_no_cold_start(tmp_path) -> None:
    a1 = _spec("a1", "bb")
    before, _launcher = _pod_agent(tmp_path, a1)
    after, next_launcher = _pod_agent(tmp_path, a1)

    async def scenario():
        instance, _ = await before._acquire(a1, 1)
        pod = instance.handle
        await before.stop()
        next_launcher.left = [pod.spec]
        adopted = await after.adopt()
        instances = after.table.all()
        await after.stop()
        return pod, adopted, instances

    pod, adopted, instances = asyncio.run(scenario())
    assert not pod.killed and not pod.worker.shut_down  # left running for the next controller
    assert adopted == 1 and next_launcher.left == []
    [instance] = instances
    assert instance.start_kind == "adopted" and instance.instance_id == pod.spec.instance_id
    assert after.functions["a1"].cold_starts == {}
    assert before.functions["a1"].cold_starts == {"libraries_preloaded": 1}
