"""The fleet benchmark's workload (lorafaas/testing/fleet_workload.py): seeded, Poisson in time, Zipf over functions."""

import itertools
import math
import statistics

import pytest

from lorafaas.testing.fleet_workload import WorkloadSpec, arrivals, zipf_weights


def test_the_same_seed_gives_the_same_sequence_and_another_seed_another() -> None:
    spec = WorkloadSpec(functions=50, rate_per_s=5.0, duration_s=60.0, seed=3)
    assert arrivals(spec) == arrivals(spec)
    assert arrivals(spec) != arrivals(WorkloadSpec(functions=50, rate_per_s=5.0, duration_s=60.0, seed=4))


def test_arrivals_are_poisson_at_the_rate_within_statistical_bounds() -> None:
    rate, duration = 20.0, 500.0
    sequence = arrivals(WorkloadSpec(functions=20, rate_per_s=rate, duration_s=duration, seed=1))
    expected = rate * duration  # a Poisson count: standard deviation sqrt(expected) = 100
    assert abs(len(sequence) - expected) < 5 * math.sqrt(expected)
    times = [a.at_s for a in sequence]
    assert times == sorted(times) and times[0] > 0 and times[-1] < duration
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # exponential gaps: mean 1/rate and standard deviation 1/rate (the mean's own error is ~1/rate/sqrt(n))
    assert statistics.mean(gaps) == pytest.approx(1 / rate, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1 / rate, rel=0.1)


def test_functions_are_chosen_by_zipf_within_statistical_bounds() -> None:
    functions = 20
    sequence = arrivals(WorkloadSpec(functions=functions, rate_per_s=20.0, duration_s=500.0, zipf_s=1.0, seed=2))
    weights = zipf_weights(functions, 1.0)
    assert weights[0] == pytest.approx(1 / sum(1 / (k + 1) for k in range(functions)))
    n = len(sequence)
    for function in (0, 1, 4, 19):
        share = sum(1 for a in sequence if a.function == function) / n
        bound = 5 * math.sqrt(weights[function] * (1 - weights[function]) / n)
        assert abs(share - weights[function]) < bound, (function, share, weights[function])
    assert {a.function for a in sequence} == set(range(functions))
    assert {a.prompt for a in sequence} == set(range(64))


def test_zipf_zero_is_uniform_and_a_steeper_exponent_concentrates_the_head() -> None:
    assert zipf_weights(4, 0.0) == [0.25] * 4
    assert zipf_weights(100, 2.0)[0] > zipf_weights(100, 1.0)[0] > zipf_weights(100, 0.5)[0]


@pytest.mark.parametrize("field", ["functions", "rate_per_s", "duration_s", "prompts"])
def test_a_workload_without_functions_rate_duration_or_prompts_is_refused(field) -> None:
    values = {"functions": 3, "rate_per_s": 1.0, "duration_s": 10.0, "prompts": 4} | {field: 0}
    with pytest.raises(ValueError, match="a workload needs"):
        arrivals(WorkloadSpec(**values))
