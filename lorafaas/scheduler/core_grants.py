"""Which instance runs its next engine step on a device's cores, and with how many threads.

A CPU device's workers ask before every step and say when it ended. Holders of a grant never use more cores than
the device has, counted across functions, so no more instances compute at once than there are cores (`cores //
base_threads`); the others wait, first come first served, for at most one step of a holder. An instance asking while
nobody else is active (holding or waiting) gets every free core up to `max_threads`: a lone batch-1 decode is
memory-bound and runs faster on two threads, but two instances on one thread each do more work than they would
taking turns on two.

Holders are opaque keys (the agent uses its connection to the worker). A holder that goes away (`gone`) gives its
cores back; a holder asks for at most one step at a time, so asking again while waiting or holding changes nothing.
A grant is a lease of `lease_s`: a holder still in its step after that (stuck, or a step far longer than any other)
no longer counts (`expire`), so one function's stuck worker cannot stall the others' steps; they then share the
cores with it as the operating system shares them, no worse than without the gate.
"""

from __future__ import annotations

import math
from collections.abc import Hashable


class CoreGrants:
    def __init__(self, cores: int, base_threads: int = 1, max_threads: int | None = None,
                 lease_s: float = math.inf) -> None:
        if cores < 1 or base_threads < 1:
            raise ValueError(f"cores ({cores}) and base_threads ({base_threads}) must be >= 1")
        self.cores = cores
        self.base_threads = min(base_threads, cores)
        self.max_threads = max(self.base_threads, min(max_threads or cores, cores))  # None: every core
        self.lease_s = lease_s
        self._holding: dict[Hashable, int] = {}  # holder -> threads granted
        self._granted_s: dict[Hashable, float] = {}  # holder -> when its grant was given
        self._waiting: dict[Hashable, None] = {}  # in the order they asked
        self.most_holding = 0  # the most holders at once: never more than cores // base_threads
        self.num_granted = 0
        self.num_waited = 0  # grants that were not given at once (the asker waited for a core)
        self.num_lapsed = 0  # grants whose lease ran out before their step ended

    @property
    def free(self) -> int:
        return self.cores - sum(self._holding.values())

    @property
    def holding(self) -> int:
        return len(self._holding)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def want(self, holder: Hashable, now_s: float = 0.0) -> list[tuple[Hashable, int]]:
        """`holder` asks for a step; returns the grants to send now: (holder, threads)."""
        if holder not in self._holding:
            self._waiting.setdefault(holder, None)
        return self._grant(now_s, asker=holder)

    def done(self, holder: Hashable, again: bool = False, now_s: float = 0.0) -> list[tuple[Hashable, int]]:
        """`holder`'s step ended (`again`: it asks for the next one, behind those already waiting)."""
        self._release(holder)
        if again:
            self._waiting.setdefault(holder, None)
        return self._grant(now_s, asker=holder if again else None)

    def gone(self, holder: Hashable, now_s: float = 0.0) -> list[tuple[Hashable, int]]:
        self._release(holder)
        self._waiting.pop(holder, None)
        return self._grant(now_s)

    def expire(self, now_s: float) -> list[tuple[Hashable, int]]:
        """Holders whose lease ran out stop counting; their cores go to those waiting."""
        lapsed = [h for h, granted_s in self._granted_s.items() if now_s - granted_s > self.lease_s]
        for holder in lapsed:
            self._release(holder)
        self.num_lapsed += len(lapsed)
        return self._grant(now_s)

    def _release(self, holder: Hashable) -> None:
        self._holding.pop(holder, None)
        self._granted_s.pop(holder, None)

    def _grant(self, now_s: float, asker: Hashable | None = None) -> list[tuple[Hashable, int]]:
        grants = []
        while self._waiting and self.free >= self.base_threads:
            holder = next(iter(self._waiting))
            del self._waiting[holder]
            alone = not self._holding and not self._waiting
            threads = min(self.max_threads, self.free) if alone else self.base_threads
            self._holding[holder] = threads
            self._granted_s[holder] = now_s
            grants.append((holder, threads))
            self.num_granted += 1
            self.num_waited += holder is not asker
        self.most_holding = max(self.most_holding, len(self._holding))
        return grants
