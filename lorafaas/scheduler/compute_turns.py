"""Whose turn it is for a device's compute under strict compute (`AdmissionView.strict_compute`).

The functions whose admission last said `no_compute` (an idle instance, or a first start, waits for a slot other
functions' instances hold), in the order they began waiting. Each executor keeps one per device and tells it every
decision; the view of a function then carries how many others wait (its running instances yield to them) and how
many wait ahead of it (a freed slot goes to the longest waiting). An executor whose queues can go away without a
last decision (a request cancelled, a function deleted) gives `stale_after_s`: a function that has not been told
`no_compute` again within it no longer counts.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

from lorafaas.scheduler.admission import AdmissionDecision
from lorafaas.scheduler.admission_view import ComputeWait


class ComputeTurns:
    def __init__(self, stale_after_s: float = math.inf) -> None:
        self.stale_after_s = stale_after_s
        self._waiting: dict[Hashable, float] = {}  # key -> when it was last told no_compute, in the order they began
        self._since: dict[Hashable, float] = {}  # key -> when it began waiting

    def note(self, key: Hashable, decision: AdmissionDecision, now_s: float) -> None:
        """The decision admission just made for `key`'s queue."""
        if decision.reason == "no_compute":
            self._waiting[key] = now_s  # a key already waiting keeps its place in the order
            self._since.setdefault(key, now_s)
        else:
            self.leave(key)

    def leave(self, key: Hashable) -> None:
        self._waiting.pop(key, None)
        self._since.pop(key, None)

    def waited_s(self, key: Hashable, now_s: float) -> float:
        """How long `key` has waited for a core (0 when it does not wait)."""
        since = self._since.get(key)
        return 0.0 if since is None else now_s - since

    def counts(self, key: Hashable, now_s: float) -> tuple[int, int]:
        """(other functions waiting, how many of them wait ahead of `key`: all of them when `key` does not wait)."""
        self._expire(now_s)
        others = sum(1 for k in self._waiting if k != key)
        if key not in self._waiting:
            return others, others
        return others, list(self._waiting).index(key)

    def wait_of(self, key: Hashable, now_s: float) -> ComputeWait:
        """`key`'s place in the turns, as its admission view carries it."""
        others, ahead = self.counts(key, now_s)
        return ComputeWait(others, ahead, self.waited_s(key, now_s))

    def waiting(self, now_s: float) -> list[Hashable]:
        self._expire(now_s)
        return list(self._waiting)

    def _expire(self, now_s: float) -> None:
        for key, seen_s in list(self._waiting.items()):
            if now_s - seen_s > self.stale_after_s:
                self.leave(key)
