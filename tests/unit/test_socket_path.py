"""A home's fixed-name sockets (the step gate's here; the zygote's in tests/integration/test_launcher.py): a server
stopping after a successor on the same home bound the same path leaves the successor's socket alone. Before
`BoundPath`, `lorafaas up` restarted while the old one was still stopping lost its step gate: the old one's cleanup
removed it, and every worker of the new one computed ungated (all own steps, no shared base pass)."""

from __future__ import annotations

import asyncio
import os
import stat
import time
from pathlib import Path

from lorafaas.function_runtime.step_gate import StepGate
from lorafaas.platform.compute_gate import ComputeGate
from lorafaas.protocols.socket_path import BoundPath
from lorafaas.scheduler import CoreGrants


def test_a_bound_path_is_removed_only_while_it_is_still_this_processs_socket(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    path.write_text("first")
    first = BoundPath(path)
    assert first.ours() and stat.S_IMODE(path.stat().st_mode) == 0o600  # only this user may connect
    time.sleep(0.05)  # a successor binds later: a later change time even where it gets the freed inode number
    path.unlink()
    path.write_text("second")  # a successor's, at the same path
    second = BoundPath(path)
    first.unlink()
    assert path.read_text() == "second" and not first.ours() and second.ours()
    second.unlink()
    assert not path.exists()
    second.unlink()  # gone already: nothing to do, no error


def test_a_stopping_gate_leaves_its_successors_socket_alone(tmp_path: Path) -> None:
    path = tmp_path / "step-gate-cpu.sock"

    def gate() -> ComputeGate:
        return ComputeGate(path, CoreGrants(cores=2), lambda pid: pid == os.getpid(), lambda pid: False)

    async def scenario() -> tuple[bool, int]:
        old, new = gate(), gate()
        await old.start()
        await new.start()  # the successor binds the same path
        await old.stop()
        still_there = path.exists()
        worker = StepGate(str(path))
        granted = asyncio.get_running_loop().run_in_executor(None, worker.acquire)
        await asyncio.wait_for(granted, timeout=10)  # the successor answers: it is still reachable
        threads = worker.threads
        worker.release(again=False)
        worker.close()
        await new.stop()
        return still_there, threads

    still_there, threads = asyncio.run(scenario())
    assert still_there and threads == 2  # a lone step on a 2-core gate: both cores
    assert not path.exists()  # the successor's own stop removes it
