"""The launcher's record of what it started: found by the next launcher only once its owner is gone."""

from __future__ import annotations

import os
import subprocess
import sys

from lorafaas.platform.backends.local_record import LauncherRecord, ProcessRef, RecordFile, dead_launchers


def test_a_live_launchers_record_is_left_alone_and_a_dead_ones_is_recovered_once(tmp_path) -> None:
    live = RecordFile(tmp_path)
    live.write(LauncherRecord(launcher_pid=os.getpid(), device="cpu", zygote=ProcessRef.of(os.getpid())))
    with dead_launchers(tmp_path) as found:
        assert found == []  # its flock is held: a launcher in this very process
    # A launcher that died: the kernel dropped its lock, its record is still there.
    script = (
        "import sys; from pathlib import Path;"
        "from lorafaas.platform.backends.local_record import LauncherRecord, ProcessRef, RecordFile;"
        "RecordFile(Path(sys.argv[1])).write(LauncherRecord(launcher_pid=1, device='cpu',"
        " daemons={'tiny': ProcessRef(pid=2, start_ticks=3)}))"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True)
    with dead_launchers(tmp_path) as found:
        assert [(record.daemons, record.zygote) for _path, record in found] == [
            ({"tiny": ProcessRef(pid=2, start_ticks=3)}, None)
        ]
    with dead_launchers(tmp_path) as found:
        assert found == []  # recovered records are removed
    assert [p.name for p in tmp_path.iterdir()] == [live.path.name]
    live.remove()
    assert list(tmp_path.iterdir()) == []


def test_a_process_ref_tells_a_reused_pid_from_the_process_recorded() -> None:
    me = ProcessRef.of(os.getpid())
    assert me.alive()
    assert not ProcessRef(pid=os.getpid(), start_ticks=me.start_ticks + 1).alive()
    assert not ProcessRef(pid=os.getpid(), start_ticks=None).alive()
