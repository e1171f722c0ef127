"""The base pass's round policy (`lorafaas.backbone_daemon.round_policy`) on hand-made calls and an injected clock:
rounds, holds, stragglers, pass order, alone-calls and their budget. No sockets, no torch."""

from __future__ import annotations

import pytest

from lorafaas.backbone_daemon.round_policy import (
    CONTINUATION,
    FUSED,
    Compute,
    Evict,
    RoundConfig,
    RoundPolicy,
    TellAlone,
)

GROUPS, FIRST_TAIL = 10, 7  # groups 0-6, then tails 7-9
CONFIG = RoundConfig(hold_s=0.05, deadline_s=0.05, penalty_passes=2, alone_share=0.25, alone_burst_s=0.5,
                     max_rows_per_group=1000)


def policy(members: int = 2, config: RoundConfig = CONFIG) -> RoundPolicy:
    p = RoundPolicy(GROUPS, FIRST_TAIL, config)
    for member in range(1, members + 1):
        p.join(member, 0.0)
    return p


def run(p: RoundPolicy, now: float, seconds: float = 0.01) -> list:
    """Every action `plan` gives at `now`, each computed in `seconds`."""
    actions = []
    while (action := p.plan(now)) is not None:
        actions.append(action)
        if isinstance(action, Compute):
            p.computed(action, seconds, now)
        elif isinstance(action, Evict):
            p.leave(action.member)
    return actions


def round_of(p: RoundPolicy, members: list[int], now: float = 0.0, fused: bool = False) -> None:
    """`members` start a pass together and get group 0 in a round."""
    for member in members:
        p.end(member, again=True)
    for member in members:
        p.receive(member, 0, 1, FUSED if fused else 0, now)
    assert run(p, now) == [Compute(tuple(members), 0, in_round=True)]


def test_two_starters_form_a_round_that_goes_group_by_group() -> None:
    p = policy()
    round_of(p, [1, 2])
    for key in range(1, FIRST_TAIL):
        now = key * 0.01
        p.receive(1, key, 1, 0, now)
        assert run(p, now) == []  # waits for member 2's call of the same group
        p.receive(2, key, 3, 0, now)
        assert run(p, now) == [Compute((1, 2), key, in_round=True)]
    assert p.stats.rounds == 1 and p.stats.stragglers == 0 and p.stats.round_calls == 2 * FIRST_TAIL


def test_a_fused_round_goes_from_group_0_to_the_tails() -> None:
    p = policy()
    round_of(p, [1, 2], fused=True)
    for key in range(FIRST_TAIL, GROUPS):
        p.receive(1, key, 1, 0, 0.0)
        p.receive(2, key, 1, 0, 0.0)
        assert run(p, 0.0) == [Compute((1, 2), key, in_round=True)]
    assert p.stats.fused_rounds == 1


def test_a_lone_starter_is_told_alone_at_once() -> None:
    p = policy()
    p.receive(1, 0, 1, 0, 0.0)
    assert run(p, 0.0) == [TellAlone(1)]
    assert p.stats.alone_passes == 1 and p.stats.holds_expired == 0


def test_a_start_is_held_for_an_active_member_until_it_starts_or_hold_s() -> None:
    p = policy()
    p.end(2, again=True)
    p.receive(1, 0, 1, 0, 0.0)
    assert run(p, 0.01) == [] and p.next_wakeup(0.01) == pytest.approx(0.01 + CONFIG.hold_s)
    p.receive(2, 0, 1, 0, 0.02)
    assert run(p, 0.02) == [Compute((1, 2), 0, in_round=True)]
    assert p.stats.holds_expired == 0


def test_an_idle_active_member_is_waited_for_once() -> None:
    """Finding 3: END with AGAIN and never a pass start holds one pass start up, not every one."""
    p = policy()
    p.end(2, again=True)
    for start in range(5):
        now = start * 1.0
        p.end(1, again=True)
        p.receive(1, 0, 1, 0, now)
        actions = run(p, now) or run(p, now + CONFIG.hold_s)
        assert actions == [TellAlone(1)]
        p.end(2, again=True)  # it keeps saying another step follows
    assert p.stats.holds_expired == 1
    p.end(1, again=False)
    p.receive(2, 0, 1, 0, 10.0)  # once it starts a pass, it is awaited again
    assert run(p, 10.0) == [TellAlone(2)]
    p.end(2, again=True)
    p.receive(1, 0, 1, 0, 11.0)
    assert run(p, 11.0) == []  # held for member 2


def test_a_straggler_leaves_the_round_and_sits_out_its_next_passes() -> None:
    p = policy(3)
    round_of(p, [1, 2, 3])
    p.receive(1, 1, 1, 0, 0.01)
    p.receive(2, 1, 1, 0, 0.01)
    assert run(p, 0.02) == []
    assert run(p, 0.01 + CONFIG.deadline_s) == [Compute((1, 2), 1, in_round=True)]  # the round goes on
    assert p.stats.stragglers == 1
    p.end(1, again=False)
    p.end(2, again=False)
    p.receive(3, 1, 1, 0, 0.1)  # its late call: an alone-call, charged to it
    assert run(p, 0.1) == [Compute((3,), 1, in_round=False)]
    for _ in range(CONFIG.penalty_passes):
        p.end(3, again=True)
        p.receive(3, 0, 1, 0, 1.0)
        assert TellAlone(3) in run(p, 1.0)
    p.end(3, again=True)
    p.receive(3, 0, 1, 0, 2.0)
    p.end(1, again=True)
    p.receive(1, 0, 1, 0, 2.0)
    assert run(p, 2.0) == [Compute((1, 3), 0, in_round=True)]  # served its penalty: in rounds again


@pytest.mark.parametrize(("key", "flags", "why"), [
    (GROUPS - 1, 0, "out of its pass's order"),  # the LM head (or a tail) with no pass: the flood of finding 1
    (3, 0, "out of its pass's order"),  # a group skipped
    (2, CONTINUATION, "continuation of group 2"),  # a chunk of a group not just answered
])
def test_a_call_out_of_its_pass_order_evicts_that_member_alone(key: int, flags: int, why: str) -> None:
    p = policy(3)
    round_of(p, [1, 2, 3])
    p.receive(3, key, 1, flags, 0.01)
    [evict] = [a for a in run(p, 0.01) if isinstance(a, Evict)]
    assert evict.member == 3 and why in evict.why
    assert p.stats.evicted == 1
    p.receive(1, 1, 1, 0, 0.02)
    p.receive(2, 1, 1, 0, 0.02)
    assert run(p, 0.02) == [Compute((1, 2), 1, in_round=True)]  # the round goes on, without waiting for it
    assert p.stats.stragglers == 0


def test_a_second_call_before_the_answer_evicts() -> None:
    p = policy()
    p.end(2, again=True)
    p.receive(1, 0, 1, 0, 0.0)
    p.receive(1, 0, 1, 0, 0.0)
    assert Evict(1, "a call before the last one was answered") in run(p, 0.0)


def test_continuation_rows_of_one_group_beyond_the_limit_evict() -> None:
    p = policy()
    round_of(p, [1, 2])
    for _ in range(CONFIG.max_rows_per_group // 250):
        p.receive(1, 0, 250, CONTINUATION, 0.0)
        assert run(p, 0.0, seconds=0.0) == [Compute((1,), 0, in_round=False)]
    p.receive(1, 0, 250, CONTINUATION, 0.0)
    [evict] = run(p, 0.0)
    assert isinstance(evict, Evict) and evict.member == 1 and "rows of group 0" in evict.why


def test_a_new_pass_resets_the_continuation_rows() -> None:
    p = policy()
    for start in range(3):
        round_of(p, [1, 2], now=float(start))
        p.receive(1, 0, 900, CONTINUATION, float(start))
        assert run(p, float(start), seconds=0.0) == [Compute((1,), 0, in_round=False)]
        p.end(1, again=False)
        p.end(2, again=False)


def test_alone_calls_spend_their_members_budget_and_wait_for_it() -> None:
    """Finding 1: a member's alone-calls take at most `alone_share` of the executor after a burst; its calls wait
    (deferred), nobody else's."""
    p = policy()
    round_of(p, [1, 2])
    p.receive(1, 0, 1, CONTINUATION, 0.0)
    assert run(p, 0.0, seconds=0.6) == [Compute((1,), 0, in_round=False)]  # the burst (0.5 s) and more
    p.receive(1, 0, 1, CONTINUATION, 0.0)
    assert run(p, 0.0) == []  # over budget: deferred
    assert p.stats.deferred == 1
    refilled = 0.1 / CONFIG.alone_share  # 0.1 s in debt, refilled at 0.25 s a second
    p.receive(2, 1, 1, 0, 0.01)  # the other member is not held: its round call goes on at the deadline
    assert run(p, CONFIG.deadline_s) == [Compute((2,), 1, in_round=True)]
    p.end(2, again=False)
    assert p.next_wakeup(0.1) == pytest.approx(refilled, rel=1e-3)
    assert run(p, refilled - 0.01) == []
    assert run(p, refilled + 0.01) == [Compute((1,), 0, in_round=False)]


def test_a_ready_round_step_goes_before_any_alone_call() -> None:
    """Alone-calls go between round steps: the round's ready step is computed first."""
    p = policy(3)
    round_of(p, [1, 2, 3])
    p.receive(1, 1, 1, 0, 0.01)
    p.receive(2, 1, 1, 0, 0.01)
    assert run(p, 0.01 + CONFIG.deadline_s) == [Compute((1, 2), 1, in_round=True)]  # member 3 straggled
    p.receive(3, 1, 1, 0, 0.07)  # its late call: alone
    p.receive(1, 2, 1, 0, 0.07)
    p.receive(2, 2, 1, 0, 0.07)
    assert run(p, 0.07) == [Compute((1, 2), 2, in_round=True), Compute((3,), 1, in_round=False)]


def test_an_alone_call_waits_while_a_round_step_is_ready() -> None:
    p = policy(3)
    round_of(p, [1, 2])
    p.receive(1, 0, 5, CONTINUATION, 0.01)  # member 1's chunk, an alone-call
    p.receive(2, 1, 1, 0, 0.01)
    actions = run(p, 0.01)
    assert actions == [Compute((1,), 0, in_round=False)]  # the round waits for member 1 anyway
    p.receive(1, 1, 1, 0, 0.02)
    assert run(p, 0.02) == [Compute((1, 2), 1, in_round=True)]


def test_alone_calls_of_several_members_are_served_oldest_first() -> None:
    p = policy(3)
    round_of(p, [1, 2, 3])
    p.receive(2, 0, 1, CONTINUATION, 0.02)
    p.receive(3, 0, 1, CONTINUATION, 0.01)
    assert run(p, 0.03) == [Compute((3,), 0, in_round=False), Compute((2,), 0, in_round=False)]


def test_a_member_that_leaves_mid_round_leaves_the_others_round_intact() -> None:
    p = policy(3)
    round_of(p, [1, 2, 3])
    p.receive(1, 1, 1, 0, 0.01)
    p.receive(2, 1, 1, 0, 0.01)
    p.leave(3)
    assert run(p, 0.01) == [Compute((1, 2), 1, in_round=True)]
    assert p.stats.stragglers == 0


def test_an_end_mid_pass_takes_the_member_out_of_the_round() -> None:
    p = policy(3)
    round_of(p, [1, 2, 3])
    p.end(3, again=False)
    p.receive(1, 1, 1, 0, 0.01)
    p.receive(2, 1, 1, 0, 0.01)
    assert run(p, 0.01) == [Compute((1, 2), 1, in_round=True)]
    p.receive(3, 1, 1, 0, 0.02)  # its pass ended: group 1 is out of order now
    assert isinstance(run(p, 0.02)[0], Evict)


@pytest.mark.parametrize("bad", [{"alone_share": 0}, {"alone_share": 1.5}, {"deadline_s": 0},
                                 {"alone_burst_s": 0}, {"max_rows_per_group": 0}, {"hold_s": -1}, {"ban_s": -1}])
def test_a_bad_config_is_refused_naming_the_value(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        RoundConfig(**bad)


def test_an_evicted_process_is_not_admitted_again_for_a_doubling_while() -> None:
    p = RoundPolicy(GROUPS, FIRST_TAIL, CONFIG)
    p.join(1, 0.0, peer=100)
    p.join(2, 0.0, peer=200)
    p.receive(1, GROUPS - 1, 1, 0, 1.0)
    assert isinstance(run(p, 1.0)[0], Evict)
    assert not p.admits(100, 1.0 + CONFIG.ban_s - 0.1) and p.admits(100, 1.0 + CONFIG.ban_s)
    assert p.admits(200, 1.0)  # another process: untouched
    p.join(3, 20.0, peer=100)
    p.receive(3, GROUPS - 1, 1, 0, 20.0)
    run(p, 20.0)
    assert not p.admits(100, 20.0 + 2 * CONFIG.ban_s - 0.1) and p.admits(100, 20.0 + 2 * CONFIG.ban_s)


def test_a_process_whose_hello_was_refused_is_not_admitted_again_for_a_doubling_while() -> None:
    """A process looping bad hellos (write-sealed buffers, forged groups) cost the executor thread a lease check, a
    decode and a failed map each, hundreds a second, taken from every member's rounds (bench hostile, attack 2)."""
    p = RoundPolicy(GROUPS, FIRST_TAIL, CONFIG)
    p.refused(100, 1.0)
    assert not p.admits(100, 1.0 + CONFIG.ban_s - 0.1) and p.admits(100, 1.0 + CONFIG.ban_s)
    assert p.admits(200, 1.0)  # another process: untouched
    p.refused(100, 20.0)
    assert not p.admits(100, 20.0 + 2 * CONFIG.ban_s - 0.1) and p.admits(100, 20.0 + 2 * CONFIG.ban_s)


def test_calls_after_an_eviction_count_for_nothing() -> None:
    p = policy()
    p.receive(1, GROUPS - 1, 1, 0, 0.0)
    p.receive(1, GROUPS - 1, 1, 0, 0.0)
    p.receive(1, 0, 1, 0, 0.0)
    assert [type(a) for a in run(p, 0.0)] == [Evict]
    assert p.stats.evicted == 1
