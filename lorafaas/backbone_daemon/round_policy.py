"""The base-pass executor's round policy (`lorafaas.backbone_daemon.base_pass`): who is in a round, what each member
may spend, when a member is a straggler and when it is evicted. Pure: no sockets, no torch, no clock of its own (every
call takes `now`); the executor feeds it what members send and applies what `plan` returns, one action at a time:

    while (action := policy.plan(now)) is not None:
        apply(action)                          # compute and answer DONE, answer ALONE, or hang up
        if computed: policy.computed(action, seconds, now)

Rules (each with a unit test, tests/unit/test_round_policy.py):

- **Pass order.** A member's calls follow its pass: a pass start (key 0), then each next group (after a FUSED start,
  key 0 then the layer tails), a CONTINUATION only of the group just answered, END at any time. Anything else (a
  loop on the LM head, a group out of order) evicts that member alone.
- **Rounds.** A pass start is held until every other awaited member (active, not sitting out) is at a pass start
  too, or `hold_s`; then two or more starters form a round and one alone is told ALONE. An awaited member not at a
  pass start when the hold runs out is not awaited again before it starts a pass (`holds_expired` counts such
  holds): an idle member that says another step follows and never starts one holds one pass start up, once. In a
  round, a member that has not called the round's group within `deadline_s` of the previous step leaves the round
  and sits out its next `penalty_passes` passes (told ALONE).
- **Alone-calls** (a continuation chunk, a call of a member out of the round) are computed only while no round step
  is ready (a ready step goes first), and each is charged to its member: the executor time its alone-calls took, in
  a bucket that fills at `alone_share` seconds a second up to `alone_burst_s`. A member whose bucket is empty waits
  (its call is deferred, others go on); one whose continuations of one group in one pass exceed
  `max_rows_per_group` rows is evicted.
- An evicted member's process, or one whose hello was refused, is not admitted again for `ban_s` (doubling with each
  strike): hung up on or refused, it cannot rejoin in a loop (each hello costs the executor thread a lease check, its
  decoding and a mapping; a process looping write-sealed or forged hellos took it from every member's rounds).
- Nothing one member does changes another's state: eviction, penalty and deferral are per member; a round is never
  dropped because of one member.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CONTINUATION = 1  # call flags (lorafaas.protocols.base_pass)
FUSED = 2


@dataclass(frozen=True)
class RoundConfig:
    hold_s: float = 0.05
    deadline_s: float = 0.05
    penalty_passes: int = 10
    alone_share: float = 0.25  # of the executor's time, per member, for its alone-calls
    alone_burst_s: float = 0.5
    max_rows_per_group: int = 32768  # continuation rows of one group in one pass (a prompt's length)
    ban_s: float = 10.0  # an evicted member's process is not admitted again for this long, doubled each time

    def __post_init__(self) -> None:
        if not (self.hold_s >= 0 and self.deadline_s > 0 and self.penalty_passes >= 0):
            raise ValueError(f"hold_s {self.hold_s} and penalty_passes {self.penalty_passes} must be >= 0, "
                             f"deadline_s {self.deadline_s} > 0")
        if self.ban_s < 0:
            raise ValueError(f"ban_s {self.ban_s} must be >= 0")
        if not (0 < self.alone_share <= 1 and self.alone_burst_s > 0 and self.max_rows_per_group > 0):
            raise ValueError(f"alone_share {self.alone_share} must lie in (0, 1], alone_burst_s "
                             f"{self.alone_burst_s} and max_rows_per_group {self.max_rows_per_group} be > 0")


@dataclass
class BasePassStats:
    rounds: int = 0
    round_calls: int = 0  # group calls computed in rounds (one per member per group)
    batched_products: int = 0  # matrix products computed for two or more members at once
    alone_calls: int = 0  # calls computed for one member (outside a round, or the last one left in it)
    alone_passes: int = 0  # passes a member was told to compute itself
    stragglers: int = 0
    refused: int = 0
    compute_s: float = 0.0  # in products and copies
    round_wait_s: float = 0.0  # from a round's group being computed to the last member's call for the next
    fused_rounds: int = 0  # rounds through the layer tails
    holds_expired: int = 0  # pass starts held the whole hold_s for an awaited member
    deferred: int = 0  # alone-calls that waited for their member's budget
    evicted: int = 0  # members hung up on by the policy (pass order, rows)


@dataclass(frozen=True)
class Compute:
    """Compute group `key` for `members` (their pending calls), then answer each DONE."""

    members: tuple[int, ...]
    key: int
    in_round: bool


@dataclass(frozen=True)
class TellAlone:
    member: int


@dataclass(frozen=True)
class Evict:
    member: int
    why: str


Action = Compute | TellAlone | Evict


@dataclass
class _State:
    pending: tuple[int, int, int] | None = None  # (key, rows, flags)
    active: bool = False  # in a pass, or said another step follows
    penalty: int = 0  # passes still to sit out
    expected: int | None = None  # the next group of its pass; None: a pass start (or END) comes next
    last_key: int | None = None  # the group last answered in this pass (a continuation may follow)
    continued_rows: int = 0  # continuation rows of last_key in this pass
    fused: bool = False  # this pass goes through the tails
    budget_s: float = 0.0
    budget_at: float = 0.0
    peer: int = 0  # its process (the executor's SO_PEERCRED pid): what an eviction bans
    evicted: bool = False  # an Evict is queued: nothing it sends counts any more
    since: float = 0.0  # when its pending call came
    deferred: bool = False  # its pending alone-call waits for its budget (counted once)
    missed_hold: bool = False  # a hold ran out waiting for it: not awaited again before it starts a pass


@dataclass
class RoundPolicy:
    num_groups: int
    first_tail: int  # num_groups without tails
    config: RoundConfig = field(default_factory=RoundConfig)
    stats: BasePassStats = field(default_factory=BasePassStats)
    _members: dict[int, _State] = field(default_factory=dict)
    _round: list[int] | None = None
    _round_key: int = 0
    _round_fused: bool = False
    _round_deadline: float = 0.0
    _hold_since: float | None = None
    _queued: list[Action] = field(default_factory=list)  # evictions and ALONE answers, in order
    _banned: dict[int, tuple[float, int]] = field(default_factory=dict)  # peer -> (admitted again from, evictions)

    # -- what members do ----------------------------------------------------------------------------------------

    def admits(self, peer: int, now: float) -> bool:
        """Whether process `peer` may join: not while a ban for an eviction of it runs (`ban_s`, doubling)."""
        until, _ = self._banned.get(peer, (0.0, 0))
        return now >= until

    def refused(self, peer: int, now: float) -> None:
        """Process `peer`'s hello was refused: a strike, as an eviction is."""
        self._strike(peer, now)

    def join(self, member: int, now: float, peer: int = 0) -> None:
        self._members[member] = _State(budget_s=self.config.alone_burst_s, budget_at=now, peer=peer)

    def leave(self, member: int) -> None:
        self._members.pop(member, None)
        if self._round is not None and member in self._round:
            self._round.remove(member)
        self._queued = [a for a in self._queued if getattr(a, "member", None) != member]

    def receive(self, member: int, key: int, rows: int, flags: int, now: float) -> None:
        """A call (already checked against the backbone: group, rows); one out of its pass order is evicted at the
        next `plan`."""
        state = self._members[member]
        if state.evicted:
            return None
        if state.pending is not None:
            return self._evict(member, "a call before the last one was answered", now)
        if flags & CONTINUATION:
            if key != state.last_key:
                return self._evict(member, f"a continuation of group {key}, not of the group just answered", now)
            state.continued_rows += rows
            if state.continued_rows > self.config.max_rows_per_group:
                return self._evict(member, f"{state.continued_rows} rows of group {key} in one pass "
                                           f"(at most {self.config.max_rows_per_group})", now)
        elif key != 0 and key != state.expected:
            return self._evict(member, f"group {key} out of its pass's order (group {state.expected} comes next)",
                               now)
        # key 0 may come at any time: a pass abandoned midway (its process computed the rest itself) ends there
        if key == 0 and not flags & CONTINUATION:
            state.missed_hold = False
        state.pending = (key, rows, flags)
        state.since = now
        return None

    def end(self, member: int, again: bool) -> None:
        """After a member's engine step: whether another follows. Its pass, if any, is over."""
        state = self._members[member]
        state.active = again
        state.expected = state.last_key = None
        if self._round is not None and member in self._round:
            self._round.remove(member)  # its pass ended without its last groups

    # -- decisions ----------------------------------------------------------------------------------------------

    def plan(self, now: float) -> Action | None:
        """The next thing to do, or None (wait for a call or `next_wakeup`)."""
        if self._queued:
            return self._queued.pop(0)
        if self._round is not None:
            step = self._step_round(now)
            if step is not None:
                return step
        alone = self._alone_call(now)
        if alone is not None:
            return alone
        if self._round is None:
            return self._start_round(now)
        return None

    def computed(self, action: Compute, seconds: float, now: float) -> None:
        """`action` was computed in `seconds` (and answered): charge alone-calls to their member, time the round."""
        for member in action.members:
            state = self._members.get(member)
            if state is None:
                continue
            key, _, flags = state.pending  # type: ignore[misc]
            state.pending = None
            if not flags & CONTINUATION:
                state.continued_rows = 0
            state.last_key = key
            if key == 0 and not flags & CONTINUATION:
                state.fused = bool(flags & FUSED)
            nxt = self.first_tail if state.fused and key == 0 else key + 1
            end = self.num_groups if state.fused else self.first_tail
            state.expected = nxt if nxt < end else None
            if not action.in_round:
                self._refill(state, now)
                state.budget_s -= seconds
        if action.in_round:
            self._round_deadline = now + self.config.deadline_s

    def next_wakeup(self, now: float) -> float | None:
        """When `plan` may have something to do without a new call: a round's deadline, a hold's end, a member's
        budget refilled."""
        times = []
        if self._round:
            times.append(self._round_deadline)
        if self._hold_since is not None:
            times.append(self._hold_since + self.config.hold_s)
        for state in self._members.values():
            if state.deferred:
                times.append(state.budget_at + (-state.budget_s + 1e-6) / self.config.alone_share)
        return min(times) if times else None

    def pending(self, member: int) -> tuple[int, int, int] | None:
        """The member's call not yet answered: (key, rows, flags)."""
        state = self._members.get(member)
        return None if state is None else state.pending

    # -- inside ---------------------------------------------------------------------------------------------------

    def _evict(self, member: int, why: str, now: float) -> None:
        self.stats.evicted += 1
        self._queued.append(Evict(member, why))
        self._members[member].evicted = True
        self._strike(self._members[member].peer, now)

    def _strike(self, peer: int, now: float) -> None:
        _, strikes = self._banned.get(peer, (0.0, 0))
        self._banned[peer] = (now + self.config.ban_s * 2 ** min(strikes, 10), strikes + 1)

    def _refill(self, state: _State, now: float) -> None:
        state.budget_s = min(self.config.alone_burst_s,
                             state.budget_s + (now - state.budget_at) * self.config.alone_share)
        state.budget_at = now

    def _is_alone_call(self, member: int, state: _State) -> bool:
        key, _, flags = state.pending  # type: ignore[misc]
        if key == 0 and not flags & CONTINUATION:
            return False  # a pass start: held for a round
        return not (self._round is not None and member in self._round and self._at_round_key(member))

    def _alone_call(self, now: float) -> Compute | None:
        """The alone-call to compute now: only while no round step is ready, of a member with budget left (the
        one that waited longest); the others wait for their budget."""
        ready = []
        for member, state in self._members.items():
            if state.pending is None or not self._is_alone_call(member, state):
                continue
            self._refill(state, now)
            if state.budget_s > 0:
                ready.append((state.since, member))
            elif not state.deferred:
                self.stats.deferred += 1
                state.deferred = True
        if not ready:
            return None
        member = min(ready)[1]
        self._members[member].deferred = False
        self.stats.alone_calls += 1
        return Compute((member,), self._members[member].pending[0], in_round=False)  # type: ignore[index]

    def _step_round(self, now: float) -> Compute | None:
        round_members = self._round or []
        ready = [m for m in round_members if self._at_round_key(m)]
        if len(ready) < len(round_members) and now < self._round_deadline:
            return None
        for member in round_members:
            if member not in ready:  # it keeps everyone waiting: out of this round, and of its next few passes
                self._members[member].penalty = self.config.penalty_passes
                self.stats.stragglers += 1
        self.stats.round_wait_s += max(0.0, now - (self._round_deadline - self.config.deadline_s))
        key = self._round_key
        self._round_key = self.first_tail if self._round_fused and key == 0 else key + 1
        end = self.num_groups if self._round_fused else self.first_tail
        self._round = ready if ready and self._round_key < end else None
        if not ready:
            return None
        if len(ready) > 1:
            self.stats.round_calls += len(ready)
        else:
            self.stats.alone_calls += 1
        return Compute(tuple(ready), key, in_round=True)

    def _at_round_key(self, member: int) -> bool:
        state = self._members[member]
        return state.pending is not None and state.pending[0] == self._round_key \
            and not state.pending[2] & CONTINUATION

    def _start_round(self, now: float) -> Action | None:
        starters = [m for m, s in self._members.items()
                    if s.pending is not None and s.pending[0] == 0 and not s.pending[2] & CONTINUATION]
        if not starters:
            self._hold_since = None
            return None
        if self._hold_since is None:
            self._hold_since = now
        awaited = [m for m, s in self._members.items()
                   if s.active and s.penalty == 0 and not s.missed_hold and m not in starters]
        if awaited and now < self._hold_since + self.config.hold_s:
            return None
        if awaited:  # the hold ran out: whoever it waited for is not waited for again before it starts a pass
            self.stats.holds_expired += 1  # (an idle member that says it is active is waited for once)
            for member in awaited:
                self._members[member].missed_hold = True
        self._hold_since = None
        eligible = [m for m in starters if self._members[m].penalty == 0]
        alone = [m for m in starters if self._members[m].penalty > 0]
        fused = {m for m in eligible if self._members[m].pending[2] & FUSED}  # type: ignore[index]
        self._round_fused = 2 * len(fused) >= len(eligible) > 0
        if 0 < len(fused) < len(eligible):  # one round at a time: the other kind computes this pass itself
            alone += [m for m in eligible if (m in fused) != self._round_fused]
            eligible = [m for m in eligible if (m in fused) == self._round_fused]
        if len(eligible) == 1:
            alone += eligible
            eligible = []
        for member in alone:
            state = self._members[member]
            state.penalty = max(0, state.penalty - 1)
            state.pending = None
            state.active = True
            state.expected = state.last_key = None
            self.stats.alone_passes += 1
            self._queued.append(TellAlone(member))
        if eligible:
            for member in eligible:
                self._members[member].active = True
            self.stats.rounds += 1
            self.stats.fused_rounds += self._round_fused
            self._round, self._round_key = eligible, 0
            self._round_deadline = now + self.config.deadline_s
            return self._step_round(now) or self.plan(now)
        return self.plan(now)
