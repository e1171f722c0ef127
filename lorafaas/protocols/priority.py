"""The data plane yields the CPU to the control plane, and a function's own compute yields it to the shared pass.

The processes that compute run below the process that started them (`lorafaas up`: the gateway, the node agent, the
step gate), so that on a machine whose cores the workers fill, routing a request, relaying a stream's tokens, granting
a step and answering /healthz are not queued behind model compute:

- a backbone daemon `DAEMON_NICENESS` below: its base pass computes the products of every member's step at once;
- function processes (the zygote, every worker it forks, pool processes, fresh workers) `FUNCTION_NICENESS` below,
  under the daemons (Linux weighs 5 against 15 about 10 to 1): a function's own compute (its prefill, its attention,
  a step it takes alone) yields the cores to the pass that every other member's step waits on. Measured (8 functions
  x 8 concurrent, float32, two cores, every step in the pass): with both at 5 a round's products took 2.3-2.8x their
  time in `bench products` (two OpenMP threads of which one shares its core with a busy process take 3.5x); with
  functions at 15, 36.6 against 28.6 tokens/s. On an idle machine niceness changes nothing: a lone function's step
  still has every core.

The starter passes the niceness to take in the child's environment (`child_env`); the child takes it at start
(`take_data_plane_niceness`): raising one's own niceness needs no privilege, and a fork inherits it.
"""

from __future__ import annotations

import os

DAEMON_NICENESS = 5  # Linux weighs nice 0 against nice 5 about 3 to 1
FUNCTION_NICENESS = 15  # against a daemon's 5 about 10 to 1
NICENESS_ENV = "LORAFAAS_NICENESS"
MAX_NICENESS = 19


def child_env(niceness: int) -> dict[str, str]:
    """This process's environment, with the niceness (DAEMON_ or FUNCTION_NICENESS) a data-plane child of it takes."""
    target = min(MAX_NICENESS, os.getpriority(os.PRIO_PROCESS, 0) + niceness)
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
