"""What a process of the platform's uid that is not root-equivalent sees of another process through /proc: run as
`capsh --drop=cap_sys_ptrace -- -c "python -m lorafaas.testing.proc_probe PID..."` beside targets started the same
way (the tests run as root: CAP_SYS_PTRACE passes `ptrace_may_access` whatever the target, and a target holding a
capability the probe lacks is closed to it anyway). Prints one
JSON line per pid: the descriptors listed in /proc/PID/fd, those it could open, and whether /proc/PID/mem opened."""

from __future__ import annotations

import contextlib
import json
import os
import sys


def probe(pid: int) -> dict:
    listed, opened, mem = [], [], False
    with contextlib.suppress(OSError):
        listed = os.listdir(f"/proc/{pid}/fd")
    for name in listed:
        try:
            fd = os.open(f"/proc/{pid}/fd/{name}", os.O_RDONLY)
        except OSError:
            continue
        opened.append(name)
        os.close(fd)
    with contextlib.suppress(OSError):
        os.close(os.open(f"/proc/{pid}/mem", os.O_RDONLY))
        mem = True
    return {"pid": pid, "listed": len(listed), "opened": opened, "mem": mem}


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(json.dumps(probe(int(arg))), flush=True)
