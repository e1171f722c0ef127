"""The MoE LoRA-server provisioning model: tau, the Poisson-binomial DP, IAR against Monte Carlo, M*, devices."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from lorafaas.scheduler.moe_provision import (
    MoeShape,
    ServerDevice,
    TpotBudget,
    free_slot_probabilities,
    immediate_admission_rate,
    min_cache_size,
    plan_devices,
    poisson_survival_table,
    residency,
    simulate_iar,
    solve_tau,
    zipf_popularity,
)

GRID = list(itertools.product([50, 200], [0.8, 1.2], [4, 16], [8, 32]))  # N, s, L, B


@pytest.mark.parametrize(("num_adapters", "s", "num_instances", "batch_size"), GRID)
def test_model_iar_matches_monte_carlo_within_two_points_at_the_minimum_cache_size(
    num_adapters: int, s: float, num_instances: int, batch_size: int
) -> None:
    popularity = zipf_popularity(num_adapters, s)
    model = min_cache_size(popularity, num_instances, batch_size, alpha=0.95)
    simulated = simulate_iar(popularity, num_instances, batch_size, model.cache_size, num_trials=3000, seed=7)
    assert model.iar >= 0.95
    assert abs(model.iar - simulated) <= 0.02, (model.cache_size, model.iar, simulated)


def test_tau_makes_the_expected_number_of_resident_adapters_exactly_the_cache_size() -> None:
    popularity = zipf_popularity(100, 1.0)
    survival = poisson_survival_table(64 * popularity)
    for cache_size in (1, 7, 30, 99):
        tau = solve_tau(survival, cache_size)
        assert residency(survival, tau).sum() == pytest.approx(cache_size, abs=1e-6)
    # between integers the residency is the survival function interpolated linearly
    q_lo, q_hi, q_mid = residency(survival, 2.0), residency(survival, 3.0), residency(survival, 2.25)
    np.testing.assert_allclose(q_mid, 0.75 * q_lo + 0.25 * q_hi)


def test_poisson_survival_matches_the_closed_form() -> None:
    lambdas = np.array([0.0, 0.5, 3.0, 40.0])
    table = poisson_survival_table(lambdas)
    for i, lam in enumerate(lambdas):
        for n in (-1, 0, 1, 5, 40):
            exact = 1.0 - sum(math.exp(-lam) * lam**k / math.factorial(k) for k in range(n + 1))
            assert table[i, n + 1] == pytest.approx(exact, abs=1e-9)


def test_free_slot_probability_equals_brute_force_enumeration() -> None:
    q = np.array([0.9, 0.2, 0.5, 0.7, 0.1])
    for cache_size in (1, 2, 3):
        free = free_slot_probabilities(q, cache_size)
        for i in range(len(q)):
            others = [j for j in range(len(q)) if j != i]
            expected = 0.0
            for bits in itertools.product([0, 1], repeat=len(others)):
                prob = math.prod(q[j] if b else 1 - q[j] for j, b in zip(others, bits, strict=True))
                expected += prob if sum(bits) < cache_size else 0.0
            assert free[i] == pytest.approx(expected, abs=1e-12)


def test_iar_grows_with_the_cache_and_the_minimum_is_the_smallest_that_reaches_alpha() -> None:
    popularity = zipf_popularity(80, 1.1)
    rates = [immediate_admission_rate(popularity, 8, 16, m).iar for m in range(1, 81)]
    assert all(b >= a - 1e-12 for a, b in itertools.pairwise(rates))
    assert rates[-1] == 1.0
    best = min_cache_size(popularity, 8, 16, alpha=0.9)
    assert rates[best.cache_size - 1] >= 0.9 > rates[best.cache_size - 2]


def test_more_skewed_popularity_needs_a_smaller_cache() -> None:
    flat = min_cache_size(zipf_popularity(200, 0.6), 8, 16).cache_size
    skewed = min_cache_size(zipf_popularity(200, 1.4), 8, 16).cache_size
    assert skewed < flat


def test_the_default_adapter_is_the_papers_mixtral_rank_64_size() -> None:
    assert MoeShape().adapter_bytes / 2**30 == pytest.approx(1.69, abs=0.01)


def test_devices_cover_memory_and_tpot_and_report_an_infeasible_budget() -> None:
    popularity = zipf_popularity(100, 1.0)
    shape, device = MoeShape(), ServerDevice()
    plan = plan_devices(shape, device, TpotBudget(), popularity, 16, 32, cache_size=100)
    assert plan.memory_devices == math.ceil(100 * shape.adapter_bytes / device.memory_bytes)
    assert plan.added_tpot_s <= TpotBudget().tpot_slo_s - TpotBudget().base_tpot_s
    tight = plan_devices(shape, device, TpotBudget(tpot_slo_s=0.0401), popularity, 64, 64, cache_size=10)
    assert tight.tpot_devices is None or tight.tpot_devices > plan.tpot_devices
    slow_link = ServerDevice(link_latency_s=0.01)
    assert plan_devices(shape, slow_link, TpotBudget(), popularity, 16, 32, 10).devices is None


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="num_adapters"):
        zipf_popularity(0, 1.0)
    with pytest.raises(ValueError, match="alpha"):
        min_cache_size(zipf_popularity(10, 1.0), 1, 1, alpha=1.5)
