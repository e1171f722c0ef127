"""The local launcher's own guarantees, on real processes: workers forked by the zygote die with it; the instances
bound to a GPU daemon that died are stopped (its memory is gone with it) and the others are left alone."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from lorafaas.formats.model_store import ModelStore
from lorafaas.function_runtime.messages import WorkerSpec
from lorafaas.function_runtime.zygote import start_zygote, zygote_status
from lorafaas.platform.backends.local import InstanceHandle, LocalLauncher
from lorafaas.protocols.daemon_config import DaemonConfig
from lorafaas.protocols.leases import process_alive, process_start_ticks


def test_the_instances_bound_to_a_dead_gpu_daemon_are_stopped_and_no_others(tmp_path) -> None:
    launcher = LocalLauncher(tmp_path, devices=("cuda:0",))
    config = DaemonConfig(home=tmp_path, backbone="b", device="cuda:0")
    other = DaemonConfig(home=tmp_path, backbone="c", device="cuda:0")
    handles = []
    for name, daemon in (("bound", config), ("elsewhere", other)):
        process = subprocess.Popen(["sleep", "60"])
        spec = WorkerSpec(function=name, instance_id=name, socket_path=str(tmp_path / f"{name}.sock"), model_dir="",
                          daemon_socket=str(daemon.paths.socket), device="cuda:0")
        handles.append(InstanceHandle(spec, process.pid, Path(os.devnull), process))
    launcher.instances.extend(handles)
    try:
        launcher._stop_bound_instances(config)
        assert handles[0].process.returncode == -signal.SIGKILL and launcher.instances == [handles[1]]
        assert handles[1].alive()
    finally:
        for handle in handles:
            handle.kill(signal.SIGKILL)


def test_workers_forked_by_the_zygote_die_with_it(tmp_path, tiny_dense_dir) -> None:
    ModelStore(tmp_path / "models").import_dir("tiny-dense", tiny_dense_dir)
    with LocalLauncher(tmp_path) as launcher:
        workers = [launcher.launch(launcher.spec(f"fn-{n}", "tiny-dense", None, shared=False)) for n in range(2)]
        started = {w.pid: process_start_ticks(w.pid) for w in workers}
        assert all(started.values())
        os.kill(launcher.zygote_pid, signal.SIGKILL)  # no chance to stop them itself
        deadline = time.monotonic() + 30
        while any(process_alive(pid, ticks) for pid, ticks in started.items()):
            assert time.monotonic() < deadline, "a worker outlived its zygote by 30 s"
            time.sleep(0.05)


def test_the_zygote_freezes_its_heap_before_forking_a_worker(tmp_path, tiny_dense_dir) -> None:
    """A worker's garbage collections must not write into the objects it inherited (each would copy its page into
    the worker's private memory): the zygote moves them out of the collector's reach before it forks."""
    ModelStore(tmp_path / "models").import_dir("tiny-dense", tiny_dense_dir)
    with LocalLauncher(tmp_path) as launcher:
        launcher.launch(launcher.spec("fn-0", "tiny-dense", None, shared=False))
        assert zygote_status(launcher.zygote_socket).frozen_objects > 10_000  # the libraries' objects, at least


def test_nothing_starts_once_the_launcher_is_closing(tmp_path, tiny_dense_dir) -> None:
    """A start that reaches the launcher after `close` began (the node agent stopping while an async invocation asked
    for an instance) is refused: before, it started a new zygote that nobody stopped."""
    import pytest

    from lorafaas.errors import PlatformUnavailable

    ModelStore(tmp_path / "models").import_dir("tiny-dense", tiny_dense_dir)
    launcher = LocalLauncher(tmp_path)
    worker = launcher.launch(launcher.spec("fn-0", "tiny-dense", None, shared=False))
    started = {pid: process_start_ticks(pid) for pid in (launcher.zygote_pid, worker.pid)}
    launcher.close()
    for fresh in (False, True):
        with pytest.raises(PlatformUnavailable, match="closing"):
            launcher.launch(launcher.spec("fn-1", "tiny-dense", None, shared=False), fresh=fresh)
    with pytest.raises(PlatformUnavailable, match="closing"):
        launcher.start_zygote()
    assert launcher.zygote_pid is None and launcher.instances == []
    deadline = time.monotonic() + 30
    while any(process_alive(pid, ticks) for pid, ticks in started.items()):
        assert time.monotonic() < deadline, "the zygote or its worker outlived close() by 30 s"
        time.sleep(0.05)


def test_the_data_plane_runs_below_the_control_planes_priority_and_functions_below_the_daemon(
        tmp_path, tiny_dense_dir) -> None:
    """The backbone daemon takes DAEMON_NICENESS more than the process that started them (`lorafaas up`), the zygote
    and the workers it forks FUNCTION_NICENESS more, so that model compute never queues the gateway's work behind it
    and no function's own compute takes a core from the shared pass every member waits on; the starter's own
    priority is left as it was."""
    from lorafaas.protocols.priority import DAEMON_NICENESS, FUNCTION_NICENESS

    ModelStore(tmp_path / "models").import_dir("tiny-dense", tiny_dense_dir)
    own = os.getpriority(os.PRIO_PROCESS, 0)
    with LocalLauncher(tmp_path) as launcher:
        worker = launcher.launch(launcher.spec("fn-0", "tiny-dense", None))
        [daemon] = launcher.daemons.processes.values()
        niceness = {kind: os.getpriority(os.PRIO_PROCESS, pid)
                    for kind, pid in (("zygote", launcher.zygote_pid), ("worker", worker.pid),
                                      ("daemon", daemon.ref.pid))}
    assert niceness == {"zygote": min(19, own + FUNCTION_NICENESS), "worker": min(19, own + FUNCTION_NICENESS),
                        "daemon": min(19, own + DAEMON_NICENESS)}
    assert own >= 4 or niceness["worker"] > niceness["daemon"]
    assert os.getpriority(os.PRIO_PROCESS, 0) == own


def test_a_zygote_stopping_after_its_successor_started_leaves_the_successors_socket(tmp_path) -> None:
    """`lorafaas up` started again on a home while the old one still stops: the old zygote's exit does not remove the
    new one's socket (same fixed path), so the new platform can still start functions."""
    path, log = tmp_path / "zygote.sock", tmp_path / "zygote.log"
    old = start_zygote(path, log)
    new = start_zygote(path, log)  # the old one answers at the path until the new one binds it (removing its file)
    try:
        deadline = time.monotonic() + 120
        while zygote_status(path).pid != new.pid:
            assert time.monotonic() < deadline, "the second zygote never bound the path"
            time.sleep(0.1)
        old.terminate()
        assert old.wait(timeout=30) is not None
        assert path.exists()
        assert zygote_status(path).pid == new.pid  # the successor still answers there
    finally:
        for process in (old, new):
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)
