"""The step gate's policy: grants of a device's cores per engine step, counted across functions."""

from __future__ import annotations

import random

import pytest

from lorafaas.scheduler import SHARED_PASS, CoreGrants, PassChoice
from lorafaas.scheduler.pass_choice import Estimate


def test_an_instance_computing_alone_gets_every_core_and_shares_them_once_another_asks() -> None:
    grants = CoreGrants(cores=2)
    assert grants.want("a") == [("a", 2)]
    assert grants.want("b") == []  # waits for a's step, at most
    # a's step ends and it wants the next: b first, then a, one core each (two steps at once beat turns on two)
    assert grants.done("a", again=True) == [("b", 1), ("a", 1)]
    assert grants.done("b") == []  # b is idle now; a keeps its one core until its step ends
    assert grants.done("a", again=True) == [("a", 2)]
    assert (grants.num_granted, grants.num_waited) == (4, 1)  # b's first step waited for a core


def test_never_more_holders_than_cores_over_base_threads_first_come_first_served() -> None:
    grants = CoreGrants(cores=4, base_threads=2)
    assert grants.want("a") == [("a", 4)]
    assert grants.want("b") == grants.want("c") == []
    assert grants.done("a", again=True) == [("b", 2), ("c", 2)]  # a asked again behind them
    assert grants.waiting == 1 and grants.holding == 2 and grants.free == 0
    assert grants.done("c") == [("a", 2)]


def test_a_holder_that_goes_gives_its_cores_back_and_asking_twice_holds_one_place() -> None:
    grants = CoreGrants(cores=2, max_threads=1)
    assert grants.want("a") == [("a", 1)]
    assert grants.want("a") == []  # already holding: no second grant
    assert grants.want("b") == [("b", 1)]
    assert grants.want("c") == grants.want("c") == []
    assert grants.waiting == 1
    assert grants.gone("a") == [("c", 1)]  # a died mid-step
    assert grants.gone("b") == [] and grants.free == 1


@pytest.mark.parametrize("cores, base", [(2, 1), (4, 1), (4, 2), (3, 2)])
def test_random_asks_never_grant_more_than_the_cores_and_every_asker_is_served(cores: int, base: int) -> None:
    rng = random.Random(cores * 10 + base)
    grants = CoreGrants(cores=cores, base_threads=base)
    holding: dict[str, int] = {}
    waiting: set[str] = set()
    for _ in range(5000):
        holder = f"i{rng.randrange(6)}"
        action = rng.choice(["want", "done", "next", "gone"])
        if action == "want":
            if holder not in holding:
                waiting.add(holder)
            given = grants.want(holder)
        elif action in ("done", "next"):
            holding.pop(holder, None)
            if action == "next":
                waiting.add(holder)
            given = grants.done(holder, again=action == "next")
        else:
            holding.pop(holder, None)
            waiting.discard(holder)
            given = grants.gone(holder)
        for who, threads in given:
            assert who in waiting and who not in holding
            waiting.discard(who)
            holding[who] = threads
            assert base <= threads <= cores
        assert sum(holding.values()) <= cores
        assert len(holding) <= cores // base
        # nobody waits while a step's worth of cores is free
        assert not waiting or cores - sum(holding.values()) < base
    assert grants.most_holding <= cores // base


def test_a_holder_stuck_past_its_lease_stops_holding_the_others_back() -> None:
    grants = CoreGrants(cores=1, lease_s=5.0)
    assert grants.want("stuck", now_s=0.0) == [("stuck", 1)]
    assert grants.want("other", now_s=1.0) == []
    assert grants.expire(now_s=5.0) == []  # within its lease
    assert grants.expire(now_s=5.5) == [("other", 1)]  # lapsed: its core goes to the one waiting
    assert grants.num_lapsed == 1 and grants.holding == 1
    # the stuck step ends at last: nothing is given back twice, and it waits its turn for the next
    assert grants.done("stuck", again=True, now_s=9.0) == []
    assert grants.done("other", now_s=9.1) == [("stuck", 1)]
    assert grants.free == 0 and grants.holding == 1


def test_nonsense_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="cores"):
        CoreGrants(cores=0)
    with pytest.raises(ValueError, match="shared_from"):
        CoreGrants(cores=2, shared_from=1)


# -- the shared base pass ---------------------------------------------------------------------------------------------


def test_members_get_cores_of_their_own_until_enough_step_at_once_then_all_go_to_the_shared_pass() -> None:
    grants = CoreGrants(cores=2, shared_from=3)
    for member in "abcd":
        grants.join(member)
    # two members stepping: each computes its own pass, on cores, as without the pass
    assert grants.want("a", now_s=0.0) == [("a", 2)]
    assert grants.want("b", now_s=0.0) == []
    assert not grants.sharing(0.0)
    # a third asks: from now on members' steps go to the shared pass, each granted as soon as the cores are free
    assert grants.want("c", now_s=0.1) == []  # a still holds both cores
    assert grants.sharing(0.1)
    assert grants.done("a", again=True, now_s=0.2) == [("b", SHARED_PASS), ("c", SHARED_PASS), ("a", SHARED_PASS)]
    assert grants.want("d", now_s=0.3) == [("d", SHARED_PASS)]  # no waiting for a core: the pass computes for all
    assert grants.holding == 0 and grants.most_sharing == 4 and grants.num_shared == 4


def test_the_pass_ends_when_members_stop_stepping_and_they_take_cores_again() -> None:
    grants = CoreGrants(cores=2, shared_from=2, shared_window_s=1.0)
    grants.join("a")
    grants.join("b")
    assert grants.want("a", now_s=0.0) == [("a", 2)]
    assert grants.want("b", now_s=0.1) == []
    assert grants.done("a", now_s=0.2) == [("b", SHARED_PASS)]  # b and a asked within the window
    assert grants.done("b", again=True, now_s=0.3) == [("b", SHARED_PASS)]
    assert grants.done("b", again=True, now_s=1.5) == [("b", 2)]  # a last asked 1.5 s ago: b is alone again


def test_shared_steps_and_core_holders_never_overlap_and_neither_starves_the_other() -> None:
    grants = CoreGrants(cores=2, shared_from=2)
    grants.join("a")
    grants.join("b")
    assert grants.want("a") == [("a", 2)]
    assert grants.want("b") == []
    assert grants.done("a", again=True) == [("b", SHARED_PASS), ("a", SHARED_PASS)]
    # a worker outside the pass (it could not join) waits for the shared steps, not for ever
    assert grants.want("outsider") == []
    assert grants.done("a", again=True) == []  # a asks behind the outsider
    assert grants.done("b", again=True) == [("outsider", 2)]
    assert grants.done("outsider") == [("a", SHARED_PASS), ("b", SHARED_PASS)]


def two_members_stepping() -> CoreGrants:
    """a holds both cores, b waits: two members asked, so the pass is on from the next grant."""
    grants = CoreGrants(cores=2, shared_from=2)
    for member in "ab":
        grants.join(member)
        grants.want(member)
    return grants


def test_a_member_that_goes_stops_counting_towards_the_pass() -> None:
    grants = two_members_stepping()
    assert grants.sharing(0.0)
    grants.gone("b")
    assert not grants.sharing(0.0)
    assert grants.done("a", again=True) == [("a", 2)]


def test_a_member_that_leaves_the_pass_gets_cores_again_and_stops_counting() -> None:
    grants = two_members_stepping()
    assert grants.leave("b") == []  # b's pass broke; a still holds both cores
    assert not grants.sharing(0.0)
    assert grants.done("a", again=True) == [("b", 1), ("a", 1)]  # cores for both, as for any two workers


def test_a_worker_that_never_joined_is_never_granted_the_shared_pass() -> None:
    grants = two_members_stepping()
    grants.want("c")  # not a member: it waits for cores however many members step
    assert all(threads != SHARED_PASS for who, threads in grants.done("a") + grants.done("b") if who == "c")
    assert grants.holding == 1


@pytest.mark.parametrize("shared_from", [2, 3])
def test_random_asks_with_the_pass_never_mix_kinds_nor_oversubscribe_and_serve_every_asker(shared_from: int) -> None:
    rng = random.Random(shared_from)
    grants = CoreGrants(cores=2, shared_from=shared_from, shared_window_s=0.5)
    members = {f"m{i}" for i in range(5)}
    for member in members:
        grants.join(member)
    holding: dict[str, int] = {}
    waiting: set[str] = set()
    now = 0.0
    for _ in range(5000):
        now += rng.random() * 0.05
        holder = rng.choice([*sorted(members), "x0", "x1"])
        action = rng.choice(["want", "done", "next"])
        if action == "want":
            if holder not in holding:
                waiting.add(holder)
            given = grants.want(holder, now_s=now)
        else:
            holding.pop(holder, None)
            if action == "next":
                waiting.add(holder)
            given = grants.done(holder, again=action == "next", now_s=now)
        for who, threads in given:
            assert who in waiting and who not in holding
            assert threads != SHARED_PASS or who in members
            waiting.discard(who)
            holding[who] = threads
        kinds = {threads == SHARED_PASS for threads in holding.values()}
        assert len(kinds) <= 1  # shared steps and core holders never at once
        assert sum(t for t in holding.values() if t != SHARED_PASS) <= 2
        if not holding:
            assert not waiting  # nobody waits on an idle device
    assert grants.num_shared > 0 and grants.most_holding <= 2


def test_a_step_that_is_no_sample_of_its_mode_is_not_measured() -> None:
    """A step that carried a prefill, or that the pass told ALONE (it computed its whole pass itself), ends unsampled:
    its time moves neither estimate. Averaged in, one slow ALONE step made the shared estimate at 8 members 0.7 s
    against 0.22 s, and eight members went to their own steps."""
    choice = PassChoice(slots=2)
    grants = CoreGrants(cores=2, choice=choice)
    for member in "ab":
        grants.join(member)
    assert grants.want("a", now_s=0.0) == [("a", 2)]  # alone: its own cores
    grants.done("a", now_s=0.05)
    assert choice.own[2].seconds == pytest.approx(0.05)
    grants.want("a", now_s=1.0)
    grants.done("a", now_s=3.0, sample=False)  # a prefill's step: 2 s, not an own step's time
    assert choice.own[2].seconds == pytest.approx(0.05) and choice.own[2].measured_s == 0.05
    choice.own[1] = Estimate(0.05, 3.0)  # the estimates the choice compares (one own step at the base threads) ...
    choice.pooled[2] = Estimate(0.03, 3.0)  # ... and the pass, measured faster: two members stepping go to it
    assert grants.want("a", now_s=3.1) == [("a", 2)]  # one member stepping: its own cores
    assert grants.want("b", now_s=3.1) == []  # two: the pass, once a's step is done
    assert sorted(grants.done("a", again=True, now_s=3.15)) == [("a", SHARED_PASS), ("b", SHARED_PASS)]
    grants.done("a", now_s=4.15, sample=False)  # told ALONE: a whole pass computed behind the executor
    assert choice.pooled[2].seconds == pytest.approx(0.03)
    grants.done("b", now_s=3.25)  # a round's step: measured
    assert choice.pooled[2].seconds == pytest.approx(0.03 + 0.25 * (0.1 - 0.03))
