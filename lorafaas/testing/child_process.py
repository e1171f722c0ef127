"""Stopping a child process the way every test and benchmark does: SIGTERM, a grace period, then SIGKILL."""

from __future__ import annotations

import subprocess
from typing import IO


def stop_child(process: subprocess.Popen, timeout_s: float = 10.0) -> int:
    """SIGTERM, wait up to `timeout_s`, then SIGKILL; its exit status. A child that already ended is only reaped."""
    if process.poll() is None:
        process.terminate()
        try:
            return process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
    return process.wait()


def stderr_tail(err: IO[bytes], nbytes: int = 1500) -> str:
    """The last `nbytes` a child wrote to `err`, a file it was given for stderr (a pipe could fill and block it)."""
    err.seek(0)
    return err.read().decode(errors="replace")[-nbytes:]
