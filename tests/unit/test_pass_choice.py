"""The step gate's measured choice between the shared base pass and members' own steps, and its grants on a busy
host. A device is simulated by step times: each grant's step ends after the time its kind takes, and every member
asks for its next step at once (a busy decode)."""

from __future__ import annotations

import heapq
from collections.abc import Callable

import pytest

from lorafaas.scheduler import SHARED_PASS, CoreGrants, PassChoice

OWN_STEP_S = {2: 0.07, 1: 0.1}  # an own step, by threads granted (a lone one is faster on both cores)


def run(grants: CoreGrants[str], members: str, shared_step_s: Callable[[float], float], until_s: float,
        count_from_s: float = 0.0, own_step_s: dict[int, float] = OWN_STEP_S) -> dict[str, int]:
    """Steps granted from `count_from_s` on, by kind, until `until_s`."""
    counts = {"shared": 0, "own": 0}
    ends: list[tuple[float, str]] = []

    def start(given: list[tuple[str, int]], now_s: float) -> None:
        for who, threads in given:
            step_s = shared_step_s(now_s) if threads == SHARED_PASS else own_step_s[threads]
            heapq.heappush(ends, (now_s + step_s, who))
            if now_s >= count_from_s:
                counts["shared" if threads == SHARED_PASS else "own"] += 1

    for member in members:
        grants.join(member)
    for member in members:
        start(grants.want(member, now_s=0.0), 0.0)
    while ends and ends[0][0] <= until_s:
        now_s, who = heapq.heappop(ends)
        start(grants.done(who, again=True, now_s=now_s), now_s)
    return counts


def measured(explore_s: float = 30.0) -> CoreGrants[str]:
    return CoreGrants(cores=2, choice=PassChoice(slots=2, explore_s=explore_s))


def test_four_members_go_to_the_pass_when_its_round_beats_their_turns_on_the_cores() -> None:
    # own: two turns of 0.1 s for four members to step once; the pass: one 0.15 s round
    counts = run(grants := measured(), "abcd", lambda now_s: 0.15, until_s=60.0)
    assert counts["shared"] > 0.95 * sum(counts.values()), counts
    assert grants.choice is not None and grants.choice.pooled[4].seconds == pytest.approx(0.15)


def test_four_members_step_on_their_own_when_the_pass_is_slower_and_it_is_only_tried_now_and_then() -> None:
    grants = measured(explore_s=30.0)
    counts = run(grants, "abcd", lambda now_s: 0.3, until_s=300.0)  # a 0.3 s round against two 0.1 s turns
    assert counts["own"] > 0.95 * sum(counts.values()), counts
    # bounded: a try per mode and k at first, then the losing mode once per 30 s
    assert grants.choice is not None and grants.choice.num_tries <= 300 / 30 + 4, grants.choice.num_tries
    assert counts["shared"] <= 4 * (300 / 30 + 4), counts


def test_members_waiting_their_turn_longer_than_the_window_still_count_as_stepping() -> None:
    # eight members on two cores, own steps of 0.6 s (a loaded host): each waits 1.8 s for its turn, beyond the 1 s
    # window, and all eight still count: a 1.5 s round beats four 0.6 s turns
    counts = run(measured(), "abcdefgh", lambda now_s: 1.5, until_s=120.0, own_step_s={2: 0.5, 1: 0.6})
    assert counts["shared"] > 0.9 * sum(counts.values()), counts


def test_a_bad_first_measurement_of_the_pass_is_corrected_by_a_later_try() -> None:
    # the pass's first rounds are slow (say, a cold executor), later ones fast: it is tried again and wins
    counts = run(measured(explore_s=10.0), "abcd", lambda now_s: 1.0 if now_s < 1.0 else 0.15, until_s=200.0,
                 count_from_s=150.0)
    assert counts["shared"] > 0.9 * sum(counts.values()), counts


def test_a_lone_member_gets_every_core_and_never_the_pass() -> None:
    grants = measured()
    counts = run(grants, "a", lambda now_s: 0.01, until_s=10.0)  # however fast the pass would be
    assert counts == {"shared": 0, "own": counts["own"]} and counts["own"] > 100
    assert grants.choice is not None and grants.choice.own[2].seconds == pytest.approx(0.07)
    assert grants.choice.num_tries == 0


def test_a_fixed_threshold_overrides_the_measured_choice() -> None:
    grants = CoreGrants(cores=2, shared_from=2, choice=PassChoice(slots=2))
    counts = run(grants, "abcd", lambda now_s: 0.3, until_s=10.0)  # slower, and granted anyway
    assert counts["own"] <= 1 and counts["shared"] > 100, counts


def test_nonsense_choice_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="weight"):
        PassChoice(slots=0)
    with pytest.raises(ValueError, match="explore_s"):
        PassChoice(slots=2, explore_s=0)


# -- a busy host ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cores, others, threads", [(2, 0.0, 2), (2, 0.6, 2), (2, 1.0, 1), (2, 12.0, 1),
                                                     (4, 1.5, 3), (4, 40.0, 1)])
def test_a_lone_step_takes_only_the_cores_other_processes_leave_free(cores: int, others: float,
                                                                     threads: int) -> None:
    grants = CoreGrants(cores=cores)
    grants.host_load(others)
    assert grants.want("a") == [("a", threads)]


def test_a_lone_step_takes_every_core_again_once_the_host_is_quiet() -> None:
    grants = CoreGrants(cores=2)
    grants.host_load(11.0)
    assert grants.want("a") == [("a", 1)]
    grants.host_load(0.0)
    assert grants.done("a", again=True) == [("a", 2)]
    # two of ours at once get one core each, whatever the host's load
    grants.host_load(11.0)
    assert grants.want("b") == []
    assert grants.done("a", again=True) == [("b", 1), ("a", 1)]


def test_near_a_tie_the_choice_keeps_its_mode_and_switches_for_a_clear_gain() -> None:
    choice = PassChoice(slots=2, weight=1.0)  # each measurement replaces the estimate
    choice.own_step(1, 0.1, now_s=0.0)  # four members: two turns, 0.2 s
    choice.shared_step(4, 0.19, now_s=0.0)  # 5% faster: not worth draining the cores' steps for
    assert choice.shared(4, now_s=1.0) is False
    choice.shared_step(4, 0.17, now_s=1.0)  # 15% faster: switch
    assert choice.shared(4, now_s=2.0) is True
    choice.shared_step(4, 0.21, now_s=2.0)  # 5% slower: stay
    assert choice.shared(4, now_s=3.0) is True
    choice.shared_step(4, 0.25, now_s=3.0)
    assert choice.shared(4, now_s=4.0) is False


def test_a_slow_shared_step_at_fewer_members_is_bounded_by_a_faster_one_at_more() -> None:
    """Measured live (8 one-row functions at 8 concurrent): shared steps at 4-7 members averaged 0.71 s (steps that
    carried a prefill, or waited out a round's hold) while steps at 8 took 0.093 s. Each request's end drops k below
    8, and those k went to own steps (ceil(k / 2) turns of 0.093 s): 30-42 tokens/s where the pass gave 60. A round
    of fewer members computes fewer rows: its step is bounded by a fresh measurement at more members."""
    choice = PassChoice(slots=2, weight=1.0)
    choice.own_step(1, 0.093, now_s=0.0)
    for k in range(4, 8):
        choice.shared_step(k, 0.71, now_s=0.0)
    choice.shared_step(8, 0.093, now_s=1.0)
    assert all(choice.shared(k, now_s=2.0) for k in range(4, 9))
    assert choice.shared_estimate(5, now_s=2.0) == pytest.approx(0.093)
    # a bound from more members lasts as long as that measurement is fresh; then k's own estimate counts again
    assert choice.shared_estimate(5, now_s=40.0) == pytest.approx(0.71)


def test_a_faster_step_at_fewer_members_is_not_raised_by_a_slower_one_at_more() -> None:
    choice = PassChoice(slots=2, weight=1.0)
    choice.shared_step(3, 0.12, now_s=0.0)
    choice.shared_step(8, 0.2, now_s=0.0)
    assert choice.shared_estimate(3, now_s=1.0) == pytest.approx(0.12)
    assert choice.shared_estimate(2, now_s=1.0) == pytest.approx(0.12)  # unmeasured at 2: bounded by 3's
    assert choice.shared_estimate(9, now_s=1.0) is None
