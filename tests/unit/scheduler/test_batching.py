"""Adaptive batching: the prefill fit, B, d = SLO - T(N), fill-or-expire, and the contention order."""

from __future__ import annotations

import math

import pytest

from lorafaas.scheduler import (
    BatchPolicy,
    PrefillModel,
    SchedulerConfig,
    in_flight_limit,
)


def fitted(points, slo_s: float = 0.5, **config) -> BatchPolicy:
    policy = BatchPolicy(SchedulerConfig(prefill_fit_decay=1.0, **config), slo_ttft_s=slo_s)
    for size, seconds in points:
        policy.observe(size, seconds)
    return policy


def test_fit_recovers_t0_and_slope_from_exact_points() -> None:
    # T(b) = 0.10 + 0.02 (b - 1): exact points are fitted exactly, with or without forgetting
    for decay in (1.0, 0.9):
        model = PrefillModel(SchedulerConfig(prefill_fit_decay=decay))
        for size, seconds in ((1, 0.10), (3, 0.14), (5, 0.18), (2, 0.12)):
            model.observe(size, seconds)
        assert model.t0_s == pytest.approx(0.10)
        assert model.a_s == pytest.approx(0.02)
        assert model.predict_s(11) == pytest.approx(0.30)


def test_least_squares_on_noisy_points() -> None:
    # x = b-1 in {0, 2, 4}, y = {0.11, 0.13, 0.19}: slope = cov/var = (0.16/3)/(8/3) = 0.02, intercept = 0.1433 - 0.04
    model = PrefillModel(SchedulerConfig(prefill_fit_decay=1.0))
    for size, seconds in ((1, 0.11), (3, 0.13), (5, 0.19)):
        model.observe(size, seconds)
    assert model.a_s == pytest.approx(0.02)
    assert model.t0_s == pytest.approx(0.43 / 3 - 0.04)


def test_priors_until_two_distinct_sizes() -> None:
    config = SchedulerConfig(prior_t0_s=0.05, prior_per_request_s=0.01, prefill_fit_decay=1.0)
    model = PrefillModel(config)
    assert (model.t0_s, model.a_s) == (0.05, 0.01)
    model.observe(4, 0.20)
    model.observe(4, 0.22)
    # one size seen: the slope stays the prior, T0 = mean(T) - a * (b - 1) = 0.21 - 0.03
    assert model.a_s == pytest.approx(0.01)
    assert model.t0_s == pytest.approx(0.18)


def test_slope_never_negative() -> None:
    model = PrefillModel(SchedulerConfig(prefill_fit_decay=1.0))
    model.observe(1, 0.20)
    model.observe(5, 0.10)
    assert model.a_s == 0.0 and model.t0_s == pytest.approx(0.15)
    with pytest.raises(ValueError, match="batch_size >= 1"):
        model.observe(0, 0.1)


def test_max_batch_within_slo() -> None:
    policy = fitted([(1, 0.10), (5, 0.18)])  # T0 0.10, a 0.02, SLO 0.5
    # B = floor((0.5 - 0.10) / 0.02) + 1 = 21: T(21) = 0.50 <= SLO < T(22) = 0.52
    assert policy.max_batch_size == 21
    assert fitted([(1, 0.10), (5, 0.18)], max_batch_size=8).max_batch_size == 8
    slow = BatchPolicy(SchedulerConfig(prior_t0_s=0.6), slo_ttft_s=0.5)  # T(1) > SLO: one at a time
    assert slow.max_batch_size == 1


def test_fill_or_expire() -> None:
    policy = fitted([(1, 0.10), (5, 0.18)])
    # N = 5: d = SLO - T(5) = 0.5 - 0.18 = 0.32
    assert policy.batch_delay_s(5) == pytest.approx(0.32)
    waiting = policy.decide(queue_len=5, oldest_wait_s=0.10, now_s=100.0)
    assert not waiting.dispatch and waiting.size == 5
    assert waiting.wait_s == pytest.approx(0.22) and waiting.recheck_at_s == pytest.approx(100.22)
    expired = policy.decide(queue_len=5, oldest_wait_s=0.32, now_s=100.22)
    assert expired.dispatch and expired.size == 5 and expired.wait_s == 0.0
    full = policy.decide(queue_len=30, oldest_wait_s=0.0, now_s=0.0)
    assert full.dispatch and full.size == 21
    empty = policy.decide(queue_len=0, oldest_wait_s=0.0, now_s=0.0)
    assert not empty.dispatch and empty.size == 0 and math.isinf(empty.wait_s)


def test_batching_switched_off_dispatches_at_once() -> None:
    policy = fitted([(1, 0.10), (5, 0.18)], adaptive_batching=False, max_batch_size=4)
    decision = policy.decide(queue_len=3, oldest_wait_s=0.0, now_s=0.0)
    assert decision.dispatch and decision.size == 3
    assert policy.decide(queue_len=9, oldest_wait_s=0.0, now_s=0.0).size == 4


def test_the_slo_batch_bounds_an_instance_while_the_excess_can_go_to_a_new_instance() -> None:
    assert in_flight_limit(slo_batch=3, worker_capacity=8, can_start_instance=True, adaptive=True) == 3


def test_without_room_for_another_instance_requests_join_a_running_batch_up_to_the_worker_capacity() -> None:
    assert in_flight_limit(slo_batch=3, worker_capacity=8, can_start_instance=False, adaptive=True) == 8


def test_a_fixed_batch_size_stays_a_hard_limit() -> None:
    assert in_flight_limit(slo_batch=1, worker_capacity=8, can_start_instance=False, adaptive=False) == 1
