"""The standby pool leaves nothing behind (platform/backends/standby_pool.py): a pool process killed while starting,
found dead in the pool, or closed with the pool takes its socket with it. SIGKILL leaves a unix socket's file on disk,
so the pool removes it; a CI run found `run/standby-*.sock` left after the platform stopped (a refill under way when
it closed). Pool processes here are real processes that listen on their socket, spawned by a stand-in for the zygote.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from lorafaas.function_runtime import messages as m
from lorafaas.platform.backends.standby_pool import StandbyPool

LISTENER = """
import socket, sys, time
time.sleep(float(sys.argv[2]))
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(sys.argv[1])
server.listen()
time.sleep(600)
"""


class Spawner:
    """Starts a process that listens on the spec's socket after `delay_s`, as a pool process does after its warm-up."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.processes: list[subprocess.Popen] = []

    def __call__(self, spec: m.WorkerSpec) -> int:
        process = subprocess.Popen([sys.executable, "-c", LISTENER, spec.socket_path, str(self.delay_s)])
        self.processes.append(process)
        return process.pid

    def wait_all_dead(self) -> None:
        """Raises TimeoutExpired if one still runs (the pool may have reaped it: it polls its pid with waitpid)."""
        for process in self.processes:
            process.wait(10)


def spec(tmp_path: Path) -> m.WorkerSpec:
    return m.WorkerSpec(function="f", instance_id="f-1", model_dir=str(tmp_path / "model"),
                        socket_path=str(tmp_path / "f.sock"), daemon_socket=str(tmp_path / "daemon.sock"))


def wait_for(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    (tmp_path / "run").mkdir()
    return tmp_path / "run"


def test_close_while_a_pool_process_starts_leaves_no_process_and_no_socket(tmp_path, run_dir) -> None:
    spawner = Spawner(delay_s=1.0)
    pool = StandbyPool(1, run_dir, spawner)
    pool.refill(spec(tmp_path), delay_s=0.0)
    wait_for(lambda: spawner.processes)
    pool.close()
    spawner.wait_all_dead()  # killed by close(), not left to listen
    time.sleep(1.5)  # past the moment it would have bound its socket
    assert not list(run_dir.glob("*.sock"))


def test_close_removes_ready_processes_and_their_sockets(tmp_path, run_dir) -> None:
    spawner = Spawner(delay_s=0.0)
    pool = StandbyPool(2, run_dir, spawner)
    pool.refill(spec(tmp_path), delay_s=0.0)
    wait_for(lambda: len(pool.pids()) == 2)
    assert len(list(run_dir.glob("standby-*.sock"))) == 2
    pool.close()
    spawner.wait_all_dead()
    assert not list(run_dir.glob("*.sock"))
    pool.refill(spec(tmp_path), delay_s=0.0)  # closed: starts nothing
    assert len(spawner.processes) == 2


def test_a_pool_process_found_dead_is_not_handed_out_and_its_socket_goes(tmp_path, run_dir) -> None:
    spawner = Spawner(delay_s=0.0)
    pool = StandbyPool(1, run_dir, spawner)
    pool.refill(spec(tmp_path), delay_s=0.0)
    wait_for(lambda: len(pool.pids()) == 1)
    [process] = spawner.processes
    process.kill()
    process.wait(10)
    pool.refill_delay_s = 60.0  # the refill behind the take stays pending: only the dead one is looked at
    assert pool.take(spec(tmp_path)) is None
    assert not list(run_dir.glob("*.sock"))
    pool.close(timeout_s=0.0)
