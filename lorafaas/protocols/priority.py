"""The data plane yields the CPU to the control plane.

The processes that compute (the zygote and every worker it forks, pool processes, fresh workers, backbone daemons)
run `DATA_PLANE_NICENESS` below the process that started them (`lorafaas up`: the gateway, the node agent, the step
gate), so that on a machine whose cores the workers fill, routing a request, relaying a stream's tokens, granting a
step and answering /healthz are not queued behind model compute. The starter passes the niceness to take in the
child's environment (`child_env`); the child takes it at start (`take_data_plane_niceness`): raising one's own
niceness needs no privilege, and a fork inherits it.
"""

from __future__ import annotations

import os

DATA_PLANE_NICENESS = 5  # Linux weighs nice 0 against nice 5 about 3 to 1
NICENESS_ENV = "LORAFAAS_NICENESS"
MAX_NICENESS = 19


def child_env() -> dict[str, str]:
    """This process's environment, with the niceness a data-plane child of it takes."""
    target = min(MAX_NICENESS, os.getpriority(os.PRIO_PROCESS, 0) + DATA_PLANE_NICENESS)
    return {**os.environ, NICENESS_ENV: str(target)}


def take_data_plane_niceness() -> None:
    """Lower this process's priority to what its starter asked (never raise it; nothing asked: nothing done)."""
    asked = os.environ.get(NICENESS_ENV)
    if not asked:
        return
    try:
        target = min(MAX_NICENESS, int(asked))
    except ValueError:
        return
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if target > current:
        os.nice(target - current)
