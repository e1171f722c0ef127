"""The step gate's policy: grants of a device's cores per engine step, counted across functions."""

from __future__ import annotations

import random

import pytest

from lorafaas.scheduler import CoreGrants


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
