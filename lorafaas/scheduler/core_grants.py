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

The shared base pass. Members of the device's base pass (`join`) can run a step's backbone products in the
executor's batched pass instead of on cores of their own: their N reads of the weights become one. Whether the k
members stepping (waiting, in a step, or asking within the last `shared_window_s`) go to it is decided from measured
step times (`choice`, `lorafaas.scheduler.pass_choice`), or, with a fixed `shared_from`, whenever k >= shared_from.
A shared grant (`SHARED_PASS`: no cores of its own; the executor computes its backbone products on the device's
cores, its own remainder runs on one thread) goes to every waiting member at once. Otherwise members get cores like
anyone else and compute their own pass. The two kinds of grant never overlap: a shared grant waits until the cores'
holders are done, a cores grant until the shared steps are done, first come first served, so neither starves the
other.

A busy host (`host_load`): a lone step gets only the cores other processes on the machine leave free (never fewer
than `base_threads`): a step on two threads with one of them preempted waits for it at every product.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Generic, TypeVar

from lorafaas.scheduler.pass_choice import PassChoice

SHARED_PASS = 0  # a grant of no cores of its own: the step's backbone products go to the device's shared base pass
H = TypeVar("H", bound=Hashable)  # what identifies a holder (the step gate: a worker's pid)


class CoreGrants(Generic[H]):
    def __init__(self, cores: int, base_threads: int = 1, max_threads: int | None = None,
                 lease_s: float = math.inf, shared_from: int | None = None, shared_window_s: float = 1.0,
                 choice: PassChoice | None = None) -> None:
        if cores < 1 or base_threads < 1:
            raise ValueError(f"cores ({cores}) and base_threads ({base_threads}) must be >= 1")
        if shared_from is not None and shared_from < 2:
            raise ValueError(f"shared_from ({shared_from}) must be >= 2: one member alone has nobody to share with")
        self.cores = cores
        self.base_threads = min(base_threads, cores)
        self.max_threads = max(self.base_threads, min(max_threads or cores, cores))  # None: every core
        self.lease_s = lease_s
        self.shared_from = shared_from
        self.shared_window_s = shared_window_s
        self.choice = choice  # the measured choice; a fixed `shared_from` overrides it
        self.others_load = 0.0  # runnable tasks on the host that are not this gate's steps (`host_load`)
        self._members: dict[H, float] = {}  # members of the base pass -> when each last asked for a step
        self._sharing: dict[H, int] = {}  # holders of a SHARED_PASS grant -> members stepping when it was given
        self._holding: dict[H, int] = {}  # holder -> threads granted
        self._granted_s: dict[H, float] = {}  # holder -> when its grant was given
        self._waiting: dict[H, None] = {}  # in the order they asked
        self.most_holding = 0  # the most holders at once: never more than cores // base_threads
        self.num_granted = 0
        self.num_waited = 0  # grants that were not given at once (the asker waited for a core)
        self.num_lapsed = 0  # grants whose lease ran out before their step ended
        self.num_shared = 0  # SHARED_PASS grants
        self.most_sharing = 0  # the most SHARED_PASS holders at once

    @property
    def free(self) -> int:
        return self.cores - sum(self._holding.values())

    @property
    def holding(self) -> int:
        return len(self._holding)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def in_pass(self) -> int:
        """Holders of a SHARED_PASS grant now."""
        return len(self._sharing)

    def join(self, holder: H) -> None:
        """`holder` is a member of the device's base pass: its steps may be granted as SHARED_PASS."""
        self._members.setdefault(holder, -math.inf)

    def leave(self, holder: H, now_s: float = 0.0) -> list[tuple[H, int]]:
        """`holder` is no longer a member (its pass went away): cores for its steps from now on."""
        self._members.pop(holder, None)
        return self._grant(now_s)

    def stepping(self, now_s: float) -> int:
        """Members stepping: waiting or in a step now, or done with one within the window. One waiting counts
        however long ago it asked: members taking turns on the cores may wait longer than the window."""
        return sum(1 for member, asked_s in self._members.items()
                   if now_s - asked_s <= self.shared_window_s or member in self._waiting
                   or member in self._holding or member in self._sharing)

    def sharing(self, now_s: float) -> bool:
        """Whether members' steps go to the shared base pass now (with `choice`: deciding may start a try)."""
        if self.shared_from is not None:
            return self.stepping(now_s) >= self.shared_from
        return self.choice is not None and self.choice.shared(self.stepping(now_s), now_s)

    def host_load(self, others: float) -> None:
        """Runnable tasks on the host besides this gate's steps (measured by the caller)."""
        self.others_load = max(0.0, others)

    def want(self, holder: H, now_s: float = 0.0) -> list[tuple[H, int]]:
        """`holder` asks for a step; returns the grants to send now: (holder, threads or SHARED_PASS)."""
        if holder not in self._holding and holder not in self._sharing:
            self._waiting.setdefault(holder, None)
            self._asked(holder, now_s)
        return self._grant(now_s, asker=holder)

    def done(self, holder: H, again: bool = False, now_s: float = 0.0, sample: bool = True) -> list[tuple[H, int]]:
        """`holder`'s step ended (`again`: it asks for the next one, behind those already waiting). `sample`: its time
        is a sample of its mode's; a step that carried a prefill, or one the pass told ALONE, is not measured (a
        shared step told ALONE computed its whole pass itself, behind the executor: averaged in, one such step
        sent eight members to their own steps)."""
        if sample:
            self._measure(holder, now_s)
        self._release(holder)
        if again:
            self._waiting.setdefault(holder, None)
            self._asked(holder, now_s)
        return self._grant(now_s, asker=holder if again else None)

    def gone(self, holder: H, now_s: float = 0.0) -> list[tuple[H, int]]:
        self._release(holder)
        self._waiting.pop(holder, None)
        self._members.pop(holder, None)
        return self._grant(now_s)

    def expire(self, now_s: float) -> list[tuple[H, int]]:
        """Holders whose lease ran out stop counting; their cores go to those waiting."""
        lapsed = [h for h, granted_s in self._granted_s.items() if now_s - granted_s > self.lease_s]
        for holder in lapsed:
            self._release(holder)
        self.num_lapsed += len(lapsed)
        return self._grant(now_s)

    def _asked(self, holder: H, now_s: float) -> None:
        if holder in self._members:
            self._members[holder] = now_s

    def _measure(self, holder: H, now_s: float) -> None:
        granted_s = self._granted_s.get(holder)
        if self.choice is None or granted_s is None:
            return
        if holder in self._sharing:
            self.choice.shared_step(self._sharing[holder], now_s - granted_s, now_s)
        elif holder in self._holding and holder in self._members:
            self.choice.own_step(self._holding[holder], now_s - granted_s, now_s)

    def _release(self, holder: H) -> None:
        self._holding.pop(holder, None)
        self._sharing.pop(holder, None)
        self._granted_s.pop(holder, None)

    def _grant(self, now_s: float, asker: H | None = None) -> list[tuple[H, int]]:
        grants = []
        # decided only when a member waits: a decision may start a try of the pass (`PassChoice`)
        shared = any(h in self._members for h in self._waiting) and self.sharing(now_s)
        stepping = self.stepping(now_s) if shared else 0
        while self._waiting:
            holder = next(iter(self._waiting))
            if shared and holder in self._members:
                if self._holding:  # the cores' holders finish their steps first
                    break
                del self._waiting[holder]
                self._sharing[holder] = stepping
                self._granted_s[holder] = now_s
                grants.append((holder, SHARED_PASS))
                self.num_granted += 1
                self.num_shared += 1
                self.num_waited += holder is not asker
                continue
            if self._sharing or self.free < self.base_threads:  # the shared steps finish first
                break
            del self._waiting[holder]
            # alone: nobody else computes, nor will before this step ends (members wait for the shared pass)
            alone = not self._holding and not any(not shared or h not in self._members for h in self._waiting)
            # alone, it takes the free cores other processes on the host leave free
            threads = self.base_threads
            if alone:
                threads = max(threads, min(self.max_threads, self.free, self.cores - math.floor(self.others_load)))
            self._holding[holder] = threads
            self._granted_s[holder] = now_s
            grants.append((holder, threads))
            self.num_granted += 1
            self.num_waited += holder is not asker
        self.most_holding = max(self.most_holding, len(self._holding))
        self.most_sharing = max(self.most_sharing, len(self._sharing))
        return grants
