"""Whether the members stepping on a device now go to its shared base pass or step on their own, from measured times.

The step gate sees every step from grant to done. This keeps two estimates per device (moving averages): an own
step's time by the threads it was granted, and a shared step's time by how many members were stepping when it was
granted (k). For k members to make one step each, own steps take `ceil(k / slots)` turns of an own step at the base
threads (no more than `slots` compute at once); the pass takes one shared step, all k together. The mode whose
estimate is the lower is chosen, by `margin` to switch (a switch waits for the other kind's steps to end). A lone
member (k = 1) always steps on its own: it has nobody to share a read with.

A round of fewer members computes fewer rows, so the shared estimate at k is bounded by any fresher than `explore_s`
at more members (`shared_estimate`): a slow average at k (steps that carried a prefill, or waited out a hold) does not
send k members to their own steps while the pass is measured faster with more of them.

Exploration, bounded: a mode never measured at k (the pass) or at the base threads (own steps), or measured longer
than `explore_s` ago, is tried once per `explore_s` for that k; a try lasts until that mode's next measurement (at
most `try_s`). So a bad first guess is corrected within one try, and a mode that loses costs at most one round per
`explore_s` per k. Pure: no clock reads, times arrive as `now_s`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

OWN, SHARED = False, True  # the two modes, as `shared(...)` answers


@dataclass
class Estimate:
    seconds: float
    measured_s: float  # when it was last measured


class PassChoice:
    def __init__(self, slots: int, base_threads: int = 1, explore_s: float = 30.0, try_s: float = 5.0,
                 weight: float = 0.25) -> None:
        if slots < 1 or base_threads < 1 or not 0 < weight <= 1 or explore_s <= 0 or try_s <= 0:
            raise ValueError(f"slots ({slots}) and base_threads ({base_threads}) must be >= 1, weight ({weight}) "
                             f"in (0, 1], explore_s ({explore_s}) and try_s ({try_s}) > 0")
        self.slots = slots
        self.base_threads = base_threads
        self.explore_s = explore_s
        self.try_s = try_s
        self.weight = weight  # of a new measurement in the moving average
        self.own: dict[int, Estimate] = {}  # threads granted -> an own step's time
        self.pooled: dict[int, Estimate] = {}  # members stepping (k) -> a shared step's time
        self._tried: dict[tuple[bool, int], float] = {}  # (mode, k) -> when it was last tried
        self._trying: tuple[bool, float] | None = None  # the mode being tried and since when
        self._last = OWN  # the mode chosen last from the estimates
        self.margin = 0.1  # the other mode's estimate must be this much lower to switch to it
        self.num_tries = 0

    def shared(self, k: int, now_s: float) -> bool:
        """Whether k members stepping now go to the shared pass (else each steps on its own cores)."""
        if k < 2:
            return OWN
        if self._trying is not None:
            mode, since_s = self._trying
            if now_s - since_s < self.try_s:
                return mode
            self._trying = None
        own, pooled = self.own.get(self.base_threads), self.pooled.get(k)
        for mode, estimate in ((SHARED, pooled), (OWN, own)):
            stale = estimate is None or now_s - estimate.measured_s > self.explore_s
            if mode == SHARED and stale and self._bound_from_more(k, now_s) is not None:
                stale = False  # known well enough: fewer members than a fresh measurement
            if stale and now_s - self._tried.get((mode, k), -math.inf) >= self.explore_s:
                self._tried[(mode, k)] = now_s
                self._trying = (mode, now_s)
                self.num_tries += 1
                return mode
        shared_s = self.shared_estimate(k, now_s)
        if shared_s is None or own is None:
            return shared_s is not None  # the one measured; neither: own steps, as without the pass
        own_s = math.ceil(k / self.slots) * own.seconds
        # a switch drains the other kind's steps first: only for a clear gain, not on noise near the tie
        if self._last == SHARED:
            self._last = own_s >= (1 - self.margin) * shared_s
        else:
            self._last = shared_s < (1 - self.margin) * own_s
        return self._last

    def shared_estimate(self, k: int, now_s: float) -> float | None:
        """A shared step's time with k members stepping: k's own average, bounded by any fresh one at more members
        (module docstring); None if neither is known."""
        own_k, bound = self.pooled.get(k), self._bound_from_more(k, now_s)
        if own_k is None:
            return bound
        return own_k.seconds if bound is None else min(own_k.seconds, bound)

    def _bound_from_more(self, k: int, now_s: float) -> float | None:
        fresh = [e.seconds for n, e in self.pooled.items() if n > k and now_s - e.measured_s <= self.explore_s]
        return min(fresh, default=None)

    def own_step(self, threads: int, seconds: float, now_s: float) -> None:
        """An own step granted `threads` took `seconds` from grant to done."""
        self._measured(self.own, threads, seconds, now_s)
        if threads == self.base_threads:
            self._tried_done(OWN)

    def shared_step(self, k: int, seconds: float, now_s: float) -> None:
        """A shared step granted while k members stepped took `seconds` from grant to done."""
        self._measured(self.pooled, k, seconds, now_s)
        self._tried_done(SHARED)

    def _measured(self, estimates: dict[int, Estimate], key: int, seconds: float, now_s: float) -> None:
        old = estimates.get(key)
        average = seconds if old is None else old.seconds + self.weight * (seconds - old.seconds)
        estimates[key] = Estimate(average, now_s)

    def _tried_done(self, mode: bool) -> None:
        if self._trying is not None and self._trying[0] == mode:
            self._trying = None
