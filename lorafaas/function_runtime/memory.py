"""A process's memory as the kernel accounts it (`/proc/PID/smaps_rollup`), for stats and benchmarks.

PSS (proportional set size) divides every shared page among the processes mapping it, so summing PSS over processes
counts a shared backbone once, which is the number that tells whether sharing works.
"""

from __future__ import annotations

import os

from lorafaas.function_runtime.messages import MemoryStats

_FIELDS = ("Rss", "Pss", "Private_Clean", "Private_Dirty", "Pss_Shmem")


def read_memory(pid: int | None = None) -> MemoryStats:
    values = dict.fromkeys(_FIELDS, 0)
    with open(f"/proc/{pid or os.getpid()}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in values:
                values[key] = int(rest.split()[0]) * 1024  # kB
    return MemoryStats(
        rss_bytes=values["Rss"],
        pss_bytes=values["Pss"],
        private_bytes=values["Private_Clean"] + values["Private_Dirty"],
        shared_bytes=values["Pss_Shmem"],
    )
