"""How many runnable tasks on the host are not the step gate's own steps (`CoreGrants.host_load`).

/proc/loadavg's fourth field counts the tasks runnable at this moment, host-wide (the reader included). Less the
threads the gate's grants hold and the reader itself, that is the other processes' demand for cores. One reading is
noisy (a worker between its step and its next ask, a request's parsing), so readings, at most one per `interval_s`,
are averaged. A host without /proc/loadavg reads as quiet (never fewer cores than without the check).
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

LOADAVG = Path("/proc/loadavg")


def runnable_tasks(path: Path = LOADAVG) -> int | None:
    """Tasks runnable now, host-wide; None where the file is missing or unreadable."""
    try:
        return int(path.read_text().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return None


class HostLoad:
    def __init__(self, path: Path = LOADAVG, interval_s: float = 0.5, weight: float = 0.3) -> None:
        self.path = path
        self.interval_s = interval_s
        self.weight = weight  # of a new reading in the average
        self.others = 0.0
        self._read_s = float("-inf")

    def sample(self, ours: int, now_s: float) -> float | None:
        """The average of runnable tasks besides `ours` (runnable threads of this agent's own); None between
        readings (no news) or where the host has no load count."""
        if now_s - self._read_s < self.interval_s:
            return None
        self._read_s = now_s
        runnable = runnable_tasks(self.path)
        if runnable is None:
            return None
        self.others += self.weight * (max(0, runnable - ours) - self.others)
        return self.others
