"""The local launcher's own guarantees, on real processes: workers forked by the zygote die with it."""

from __future__ import annotations

import os
import signal
import time

from lorafaas.backbone_daemon.leases import process_alive, process_start_ticks
from lorafaas.function_runtime.launcher import LocalLauncher
from lorafaas.platform.model_store import ModelStore


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
