"""Which instance runs its next engine step on a device's cores, and with how many threads.

A CPU device's workers ask before every step and say when it ended. Holders of a grant never use more cores than
the device has, counted across functions, so no more instances compute at once than there are cores (`cores //
base_threads`); the others wait, first come first served, for at most one step of a holder. An instance asking while
nobody else is active (holding or waiting) gets every free core up to `max_threads`: a lone batch-1 decode is
memory-bound and runs faster on two threads, but two instances on one thread each do more work than they would
taking turns on two.

Holders are opaque keys (the agent uses its connection to the worker). A holder that goes away (`gone`) gives its
cores back; a holder asks for at most one step at a time, so asking again while waiting or holding changes nothing.
"""

from __future__ import annotations

from collections.abc import Hashable


class CoreGrants:
    def __init__(self, cores: int, base_threads: int = 1, max_threads: int | None = None) -> None:
        if cores < 1 or base_threads < 1:
            raise ValueError(f"cores ({cores}) and base_threads ({base_threads}) must be >= 1")
        self.cores = cores
        self.base_threads = min(base_threads, cores)
        self.max_threads = max(self.base_threads, min(max_threads or cores, cores))  # None: every core
        self._holding: dict[Hashable, int] = {}  # holder -> threads granted
        self._waiting: dict[Hashable, None] = {}  # in the order they asked
        self.most_holding = 0  # the most holders at once: never more than cores // base_threads
        self.num_granted = 0
        self.num_waited = 0  # grants that were not given at once (the asker waited for a core)

    @property
    def free(self) -> int:
        return self.cores - sum(self._holding.values())

    @property
    def holding(self) -> int:
        return len(self._holding)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def want(self, holder: Hashable) -> list[tuple[Hashable, int]]:
        """`holder` asks for a step; returns the grants to send now: (holder, threads)."""
        if holder not in self._holding:
            self._waiting.setdefault(holder, None)
        return self._grant(asker=holder)

    def done(self, holder: Hashable, again: bool = False) -> list[tuple[Hashable, int]]:
        """`holder`'s step ended (`again`: it asks for the next one, behind those already waiting)."""
        self._holding.pop(holder, None)
        if again:
            self._waiting.setdefault(holder, None)
        return self._grant(asker=holder if again else None)

    def gone(self, holder: Hashable) -> list[tuple[Hashable, int]]:
        self._holding.pop(holder, None)
        self._waiting.pop(holder, None)
        return self._grant()

    def _grant(self, asker: Hashable | None = None) -> list[tuple[Hashable, int]]:
        grants = []
        while self._waiting and self.free >= self.base_threads:
            holder = next(iter(self._waiting))
            del self._waiting[holder]
            alone = not self._holding and not self._waiting
            threads = min(self.max_threads, self.free) if alone else self.base_threads
            self._holding[holder] = threads
            grants.append((holder, threads))
            self.num_granted += 1
            self.num_waited += holder is not asker
        self.most_holding = max(self.most_holding, len(self._holding))
        return grants
