"""Online arrival rates over an injected clock."""

from __future__ import annotations

import math
import random

import pytest
from scheduler_builders import fn, view

from lorafaas.scheduler import RateTracker, SchedulerConfig


def poisson(tracker: RateTracker, function: str, rate: float, start_s: float, end_s: float, seed: int = 0) -> float:
    rng, t = random.Random(seed), start_s
    while True:
        t += rng.expovariate(rate)
        if t > end_s:
            return end_s
        tracker.observe_arrival(function, t)


def test_steady_rate_is_estimated() -> None:
    tracker = RateTracker(SchedulerConfig(rate_window_s=60))
    now = poisson(tracker, "f", 2.0, 0.0, 600.0)
    assert tracker.rate("f", now) == pytest.approx(2.0, rel=0.25)


def test_unbiased_from_the_start() -> None:
    # deterministic arrivals every 0.5 s for 10 s: without the start-up correction the estimate would be ~0.3/s
    tracker = RateTracker(SchedulerConfig(rate_window_s=60))
    for k in range(20):
        tracker.observe_arrival("f", 0.5 * k)
    assert tracker.rate("f", 10.0) == pytest.approx(2.0, rel=0.1)


def test_rate_decays_when_arrivals_stop() -> None:
    tracker = RateTracker(SchedulerConfig(rate_window_s=60))
    for k in range(2400):  # 2/s for 20 minutes
        tracker.observe_arrival("f", 0.5 * k)
    at_stop = tracker.rate("f", 1200.0)
    assert tracker.rate("f", 1200.0 + 60 * math.log(2)) == pytest.approx(at_stop / 2, rel=1e-3)
    assert tracker.rate("never", 0.0) is None


def test_apply_replaces_rates_of_observed_functions_only() -> None:
    tracker = RateTracker(SchedulerConfig(rate_window_s=60))
    for k in range(20):
        tracker.observe_arrival("a", 0.5 * k)
    rated = tracker.apply(view([fn("a", rate=9.0), fn("b", rate=7.0)]), 10.0)
    assert rated.functions["a"].arrival_rate_per_s == pytest.approx(2.0, rel=0.1)
    assert rated.functions["b"].arrival_rate_per_s == 7.0


def test_replan_only_on_a_real_change() -> None:
    tracker = RateTracker(SchedulerConfig(rate_window_s=60, rate_change_tolerance=0.25))
    now = poisson(tracker, "f", 2.0, 0.0, 600.0, seed=1)
    tracker.mark_planned(now)
    assert not tracker.changed_since_plan(now + 0.5)
    now = poisson(tracker, "f", 8.0, now, now + 60.0, seed=2)  # the rate quadruples
    assert tracker.changed_since_plan(now)
    tracker.mark_planned(now)
    tracker.forget("f")
    assert not tracker.changed_since_plan(now)


def test_no_deployed_function_is_planned_below_the_floor() -> None:
    """A function never invoked, or quiet for hours, is still planned at `rate_floor_per_s`, so its artifacts are
    staged in idle memory before its first burst (Bursty's worst TTFTs were first bursts loading from disk)."""
    tracker = RateTracker(SchedulerConfig(rate_window_s=60, rate_floor_per_s=1 / 3600))
    tracker.observe_arrival("quiet", 0.0)
    functions = [fn("quiet", rate=0.0), fn("never", rate=0.0), fn("hot", rate=5.0)]
    tracker.apply(view(functions), 0.0)  # deployed at 0
    rated = tracker.apply(view(functions), 4 * 3600.0)
    assert rated.functions["quiet"].arrival_rate_per_s == pytest.approx(1 / 3600)
    assert rated.functions["never"].arrival_rate_per_s == pytest.approx(1 / 3600)
    assert rated.functions["hot"].arrival_rate_per_s == 5.0  # never seen here: it keeps the rate it came with
    off = RateTracker(SchedulerConfig(rate_floor_per_s=0.0, device_preload_horizon_s=0.0)).apply(
        view([fn("never", rate=0.0)]), 10.0)
    assert off.functions["never"].arrival_rate_per_s == 0.0
    with pytest.raises(ValueError, match="rate_floor_per_s"):
        SchedulerConfig(rate_floor_per_s=-1.0)


def test_a_function_just_deployed_is_expected_within_the_device_horizon() -> None:
    """A deploy is usually followed by its first calls: not yet invoked, a function counts as expected within
    `device_preload_horizon_s` of the first plan that saw it, so the device tier stages it; after that, the floor."""
    tracker = RateTracker(SchedulerConfig(rate_floor_per_s=1 / 3600, device_preload_horizon_s=600.0))
    functions = [fn("new", rate=0.0)]
    assert tracker.apply(view(functions), 100.0).functions["new"].arrival_rate_per_s == pytest.approx(1 / 600)
    assert tracker.apply(view(functions), 699.0).functions["new"].arrival_rate_per_s == pytest.approx(1 / 600)
    assert tracker.apply(view(functions), 700.0).functions["new"].arrival_rate_per_s == pytest.approx(1 / 3600)
    tracker.forget("new")  # deleted, then deployed again (maybe by another tenant): a new deploy
    assert tracker.apply(view(functions), 5000.0).functions["new"].arrival_rate_per_s == pytest.approx(1 / 600)
    tracker.observe_arrival("new", 5001.0)  # invoked: its own rate from then on
    rate = tracker.apply(view(functions), 5400.0).functions["new"].arrival_rate_per_s
    assert rate == pytest.approx(max(1 / 3600, tracker.rate("new", 5400.0)))


def test_poisson_arrivals_are_steady_on_off_and_bursty_ones_are_not() -> None:
    steady, on_off, bursty = RateTracker(), RateTracker(), RateTracker()
    poisson(steady, "f", 0.05, 0.0, 4 * 3600.0, seed=1)
    t = 0.0
    for stretch in range(12):  # 10 minutes on at one a minute-ish, 20 minutes off
        t = poisson(on_off, "f", 0.05, t, t + 600.0, seed=stretch) + 1200.0
    for burst in range(6):  # 20 at once, an hour apart
        bursty.observe_arrival("f", burst * 3600.0, count=20)
    assert steady.steady("f")
    assert not on_off.steady("f")
    assert not bursty.steady("f")


def test_steadiness_needs_enough_gaps_forgets_old_ones_and_can_be_switched_off() -> None:
    tracker = RateTracker(SchedulerConfig(steady_min_gaps=10, steady_max_gaps=20))
    for k in range(10):  # 10 arrivals: 9 gaps
        tracker.observe_arrival("f", 60.0 * k)
    assert not tracker.steady("f")  # too few gaps to tell
    tracker.observe_arrival("f", 600.0)
    assert tracker.steady("f")  # evenly spaced: CV 0
    tracker.observe_arrival("f", 600.0, count=30)  # a burst: 30 gaps of 0 fill the window
    assert not tracker.steady("f")
    for k in range(1, 21):  # 20 evenly spaced arrivals push the burst out of the last 20 gaps
        tracker.observe_arrival("f", 600.0 + 60.0 * k)
    assert tracker.steady("f")
    tracker.forget("f")
    assert not tracker.steady("f")
    off = RateTracker(SchedulerConfig(steady_min_gaps=0))
    for k in range(200):
        off.observe_arrival("f", 60.0 * k)
    assert not off.steady("f")


def test_gap_variation_tells_bursts_from_on_off_stretches() -> None:
    steady, on_off, bursty, few = RateTracker(), RateTracker(), RateTracker(), RateTracker()
    poisson(steady, "f", 0.05, 0.0, 4 * 3600.0, seed=1)
    t = 0.0
    for stretch in range(12):  # 10 minutes on at about one every 20 s, 20 minutes off
        t = poisson(on_off, "f", 0.05, t, t + 600.0, seed=stretch) + 1200.0
    for burst in range(4):  # 40 at once, an hour apart: CV sqrt(39)
        bursty.observe_arrival("f", burst * 3600.0, count=40)
    for k in range(10):  # 9 gaps: too few to tell
        few.observe_arrival("f", 3600.0 * (k % 2) + k)
    assert 0.8 < steady.gap_variation("f") < 1.2
    assert 1.5 < on_off.gap_variation("f") < 5.0
    assert bursty.gap_variation("f") > 5.0
    assert few.gap_variation("f") is None
    assert RateTracker().gap_variation("never seen") is None
    simultaneous = RateTracker()
    simultaneous.observe_arrival("f", 5.0, count=50)  # every gap 0: no variation to speak of
    assert simultaneous.gap_variation("f") is None


def test_recent_arrivals_count_the_burst_window_in_the_first_minutes_of_traffic() -> None:
    tracker = RateTracker(SchedulerConfig(burst_window_s=10.0, early_scale_out_s=300.0))
    assert tracker.recent_arrivals("f", 0.0) == 0
    tracker.observe_arrival("f", 0.0)
    tracker.observe_arrival("f", 5.0, count=3)
    assert tracker.recent_arrivals("f", 9.0) == 4
    assert tracker.recent_arrivals("f", 12.0) == 3  # the first left the window
    tracker.observe_arrival("f", 301.0)
    assert tracker.recent_arrivals("f", 301.0) == 0  # traffic older than early_scale_out_s: its rates say enough
    off = RateTracker(SchedulerConfig(burst_window_s=0.0))
    off.observe_arrival("f", 0.0)
    assert off.recent_arrivals("f", 0.0) == 0
    tracker.forget("f")
    assert tracker.recent_arrivals("f", 301.0) == 0
