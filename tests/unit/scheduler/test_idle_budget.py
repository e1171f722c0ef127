"""Keep-alive under a memory budget (`idle_budget.keep_within_budget`): value per byte, never over the budget."""

from __future__ import annotations

import random

from lorafaas.scheduler import IdleInstance, InstanceId, keep_within_budget
from lorafaas.scheduler.messages import FunctionName

MB = 1024**2


def _idle(name: str, fn: str, mb: int, rate_per_s: float, cold_s: float = 2.0, window_s: float = 600.0,
          last_used_s: float = 0.0) -> IdleInstance:
    return IdleInstance(InstanceId(name), FunctionName(fn), mb * MB, rate_per_s, cold_s, window_s, last_used_s)


def test_a_popular_small_function_is_kept_over_a_rare_large_one() -> None:
    popular = _idle("p0", "popular", 100, rate_per_s=1 / 60)
    rare = _idle("r0", "rare", 400, rate_per_s=1 / 36_000, cold_s=5.0)
    decision = keep_within_budget([rare, popular], budget_bytes=450 * MB)
    assert decision.keep == ("p0",)
    assert decision.retire == ("r0",)
    assert decision.kept_bytes == 100 * MB


def test_a_budget_that_fits_all_keeps_all() -> None:
    instances = [_idle(f"i{k}", f"f{k}", 50 + k, rate_per_s=1e-4 * k) for k in range(20)]
    decision = keep_within_budget(instances, budget_bytes=sum(i.private_bytes for i in instances))
    assert set(decision.keep) == {i.instance_id for i in instances}
    assert decision.retire == ()


def test_idle_instances_never_exceed_the_budget_and_the_densest_are_kept() -> None:
    rng = random.Random(7)
    for trial in range(200):
        instances = [_idle(f"i{k}", f"f{rng.randrange(30)}", rng.randint(5, 400), rng.expovariate(1 / 300) ** -1,
                           cold_s=rng.uniform(0.1, 10), window_s=rng.choice([60.0, 600.0]),
                           last_used_s=rng.uniform(0, 100)) for k in range(rng.randint(0, 60))]
        budget = rng.randint(0, 4000) * MB
        decision = keep_within_budget(instances, budget)
        by_id = {i.instance_id: i for i in instances}
        kept = sum(by_id[i].private_bytes for i in decision.keep)
        assert kept == decision.kept_bytes <= budget, trial
        assert sorted(decision.keep + decision.retire) == sorted(by_id)
        if kept < budget:  # something left out must not have fit in what remained
            left = budget - kept
            assert all(by_id[i].private_bytes > left for i in decision.retire), trial


def test_the_retired_come_lowest_value_per_byte_first() -> None:
    instances = [_idle("hot", "a", 100, 1 / 10), _idle("warm", "b", 100, 1 / 600), _idle("cold", "c", 100, 1 / 86_400)]
    decision = keep_within_budget(instances, budget_bytes=100 * MB)
    assert decision.keep == ("hot",)
    assert decision.retire == ("cold", "warm")


def test_a_negative_budget_is_refused() -> None:
    try:
        keep_within_budget([], -1)
    except ValueError as exc:
        assert "-1 bytes" in str(exc)
    else:
        raise AssertionError("a negative budget was accepted")
