"""The step gate's wire for the shared base pass, over a real Unix socket: a worker the agent started in the pass says
so and is granted steps in it once enough members step; a worker that says so and is not is hung up on (shared grants
to it would take cores nobody accounts for), and then computes ungated, never in the pass. The host's load is read
from a file written here (quiet unless a test says otherwise): this machine's own load is not the test's."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest

from lorafaas.function_runtime.step_gate import StepGate
from lorafaas.platform.compute_gate import ComputeGate
from lorafaas.platform.host_load import HostLoad
from lorafaas.scheduler import SHARED_PASS, CoreGrants, PassChoice


@pytest.fixture()
def gate_server(tmp_path: Path):
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    started: list[ComputeGate] = []

    async def call(fn):
        return fn()

    def start(is_member: bool, grants: CoreGrants, runnable: int = 1) -> ComputeGate:
        loadavg = tmp_path / f"loadavg-{len(started)}"
        loadavg.write_text(f"0.00 0.00 0.00 {runnable}/100 1\n")  # the format of /proc/loadavg
        gate = ComputeGate(tmp_path / f"gate-{len(started)}.sock", grants, lambda pid: pid == os.getpid(),
                           lambda pid: is_member and pid == os.getpid(), HostLoad(loadavg, weight=1.0))
        asyncio.run_coroutine_threadsafe(gate.start(), loop).result(timeout=10)
        started.append(gate)
        return gate

    def on_loop(fn):  # the gate's CoreGrants belong to its event loop's thread
        return asyncio.run_coroutine_threadsafe(call(fn), loop).result(timeout=10)

    yield start, on_loop
    for gate in started:
        asyncio.run_coroutine_threadsafe(gate.stop(), loop).result(timeout=10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)


def member_that_stepped(gate_server) -> tuple[CoreGrants, StepGate]:
    """A worker the agent started in the pass, connected, that has run one step: alone, so on every core."""
    gate_of, _ = gate_server
    grants = CoreGrants(cores=2, shared_from=2)
    gate = gate_of(True, grants)
    worker = StepGate(str(gate.path))
    worker.declare_member()
    worker.acquire()
    assert (worker.shared, worker.threads) == (False, 2)
    worker.release(again=False)
    return grants, worker


def test_a_member_is_granted_its_steps_in_the_shared_pass_once_enough_members_step(gate_server) -> None:
    on_loop = gate_server[1]
    grants, worker = member_that_stepped(gate_server)
    deadline = time.monotonic() + 10
    while on_loop(lambda: grants.holding) and time.monotonic() < deadline:  # the gate read its DONE
        time.sleep(0.01)
    on_loop(lambda: grants.join("another member"))  # another function's worker steps now: two members stepping
    assert on_loop(lambda: grants.want("another member", time.monotonic())) == [("another member", SHARED_PASS)]
    worker.acquire()
    assert worker.shared and worker.threads == 1  # its own remainder on one thread; the executor has the cores
    worker.release(again=False)
    assert grants.num_shared == 2


def test_a_worker_outside_the_pass_that_claims_it_is_hung_up_on_and_computes_ungated(gate_server) -> None:
    gate_of, on_loop = gate_server
    grants = CoreGrants(cores=2, shared_from=2)
    gate = gate_of(False, grants)
    worker = StepGate(str(gate.path), member=True)
    worker.acquire()
    assert not worker.shared and worker._broken  # the gate closed on it: it computes as the OS shares the cores
    on_loop(lambda: grants.join("a member"))
    on_loop(lambda: grants.want("a member", time.monotonic()))
    assert not on_loop(lambda: grants.sharing(time.monotonic()))  # the claim counted for nothing
    assert grants.num_shared == 0


def test_a_member_whose_pass_broke_leaves_it_and_is_granted_cores(gate_server) -> None:
    on_loop = gate_server[1]
    grants, worker = member_that_stepped(gate_server)
    worker.leave_pass()  # its executor went away: it computes every step itself
    deadline = time.monotonic() + 10
    while on_loop(lambda: os.getpid() in grants._members) and time.monotonic() < deadline:
        time.sleep(0.01)
    on_loop(lambda: grants.join("another member"))
    on_loop(lambda: grants.want("another member", time.monotonic()))  # one member stepping: cores for it too
    assert not on_loop(lambda: grants.sharing(time.monotonic()))
    on_loop(lambda: grants.done("another member"))
    worker.acquire()
    assert not worker.shared and worker.threads == 2  # cores of its own, not a SHARED grant
    worker.release(again=False)


def test_on_a_busy_host_a_lone_worker_is_granted_one_thread(gate_server) -> None:
    gate_of, _ = gate_server
    gate = gate_of(False, CoreGrants(cores=2), runnable=12)  # eleven runnable tasks besides the gate's process
    worker = StepGate(str(gate.path))
    worker.acquire()
    assert (worker.shared, worker.threads) == (False, 1)
    worker.release(again=False)
    worker.close()


def test_a_step_released_unsampled_is_not_measured_and_the_next_grant_still_comes(gate_server) -> None:
    """`release(sample=False)` (a prefill in the step, or the pass told it ALONE) ends the step as DONE and NEXT do,
    grant included, and its time moves no estimate; a sampled one does."""
    gate_of, on_loop = gate_server
    choice = PassChoice(slots=2)
    grants = CoreGrants(cores=2, choice=choice)
    gate = gate_of(True, grants)
    worker = StepGate(str(gate.path))
    worker.declare_member()  # a member alone: own steps on every core, measured
    worker.acquire()
    time.sleep(0.05)
    worker.release(again=True, sample=False)
    worker.acquire()  # NEXT's grant, read as after a sampled NEXT
    assert worker.threads == 2 and on_loop(lambda: dict(choice.own)) == {}
    worker.release(again=False)
    deadline = time.monotonic() + 10
    while not on_loop(lambda: dict(choice.own)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert list(on_loop(lambda: dict(choice.own))) == [2]
    worker.close()
