"""Workload building: CoV classes on a hand-made trace, seeded expansion, mapping, token lengths, compression."""

import math
import random
from datetime import datetime, timedelta

import pytest

from lorafaas.errors import InvalidInput
from lorafaas.replay.traces import FunctionMinuteCounts, LLMRequest
from lorafaas.replay.workload import (
    Mapping,
    TokenSampler,
    classify,
    expand_minute_counts,
    inter_arrival_cov,
    select_per_class,
    stats_2019,
    workload_from_llm,
    workload_from_minute_counts,
)


def _row(name: str, counts: list[int]) -> FunctionMinuteCounts:
    return FunctionMinuteCounts("o", "app", name, "http", tuple(counts))


# A hand-made day of 60 minutes:
#   steady: 2 per minute every minute                        -> equal gaps, CoV 0 -> predictable
#   every_other: 1 call every other minute                    -> equal gaps, CoV 0 -> predictable
#   normalish: 1 per minute for 20 minutes, then one at minute 59          -> normal
#   burst: 30 calls in minute 0 and 30 in minute 59 (two tight clusters)   -> bursty
STEADY = [2] * 60
EVERY_OTHER = [1 if m % 2 == 0 else 0 for m in range(60)]
NORMALISH = [1 if m < 20 else 0 for m in range(60)]
NORMALISH[59] = 1
BURST = [0] * 60
BURST[0] = BURST[59] = 30


def test_cov_by_hand() -> None:
    assert inter_arrival_cov([0, 10, 20, 30]) == 0.0
    # gaps 1, 3: mean 2, population std 1 -> CoV 0.5
    assert inter_arrival_cov([0, 1, 4]) == pytest.approx(0.5)
    assert math.isnan(inter_arrival_cov([1.0, 2.0]))


def test_classes_on_hand_made_trace() -> None:
    stats = {
        s.key.split("/")[1]: s
        for s in stats_2019(
            [
                _row("steady", STEADY),
                _row("every_other", EVERY_OTHER),
                _row("normalish", NORMALISH),
                _row("burst", BURST),
                _row("once", [1] + [0] * 59),
            ]
        )
    }
    assert stats["steady"].cov == pytest.approx(0.0) and stats["steady"].trace_class == "predictable"
    assert stats["every_other"].cov == pytest.approx(0.0) and stats["every_other"].trace_class == "predictable"
    # 19 gaps of 60 s and one of 2400 s: mean 177, std 509.99 -> CoV 2.881
    assert stats["normalish"].cov == pytest.approx(2.8813, abs=1e-3)
    assert stats["normalish"].trace_class == "normal"
    # 58 gaps of 2 s and one of 3482 s: mean 60.98, std 449.20 -> CoV 7.366
    assert stats["burst"].cov == pytest.approx(7.3660, abs=1e-3)
    assert stats["burst"].trace_class == "bursty"
    assert stats["once"].trace_class is None and stats["once"].num_invocations == 1


def test_class_boundaries() -> None:
    assert classify(1.0) == "predictable"
    assert classify(1.0001) == "normal"
    assert classify(4.0) == "normal"
    assert classify(4.0001) == "bursty"


def test_expansion_uniform_and_seeded_poisson_golden() -> None:
    assert expand_minute_counts([2, 0, 1]) == [15.0, 45.0, 150.0]
    times = expand_minute_counts([2, 0, 1], "poisson", random.Random(7))
    assert [round(t, 6) for t in times] == [9.05095, 19.429966, 159.056068]
    assert times == expand_minute_counts([2, 0, 1], "poisson", random.Random(7))
    assert times != expand_minute_counts([2, 0, 1], "poisson", random.Random(8))
    with pytest.raises(InvalidInput, match="choose 'uniform' or 'poisson'"):
        expand_minute_counts([1], "exponential")  # type: ignore[arg-type]


def test_seeded_selection_per_class() -> None:
    rows = [_row(f"p{i}", STEADY) for i in range(10)] + [_row(f"b{i}", BURST) for i in range(5)]
    stats = stats_2019(rows)
    chosen = select_per_class(stats, {"predictable": 3, "bursty": 2}, seed=1)
    assert chosen == select_per_class(stats, {"predictable": 3, "bursty": 2}, seed=1)
    assert len(chosen["predictable"]) == 3 and all("/p" in k for k in chosen["predictable"])
    assert len(chosen["bursty"]) == 2 and all("/b" in k for k in chosen["bursty"])
    with pytest.raises(InvalidInput, match="3 normal functions wanted; the trace has 0"):
        select_per_class(stats, {"normal": 3}, seed=1)


def test_mapping_and_minute_count_workload() -> None:
    mapping = Mapping.parse(["app/steady=pirate", "*=haiku", "*=french"])
    assert mapping.targets("app/steady") == ("pirate",)
    assert mapping.targets("anything") == ("haiku", "french")
    with pytest.raises(InvalidInput, match="is not TRACE_FN=FUNCTION"):
        Mapping.parse(["pirate"])
    sampler = TokenSampler([(100, 10), (2000, 300)], random.Random(3), max_prompt_tokens=512, max_output_tokens=64)
    work = workload_from_minute_counts(
        [_row("steady", STEADY[:3]), _row("burst", [1, 0, 2])], mapping, sampler, seed=5, mode="uniform"
    )
    assert len(work.requests) == 9 and work.duration_s == 180.0
    assert [r.arrival_s for r in work.requests][:3] == [15.0, 30.0, 45.0]
    assert {r.function for r in work.requests if r.trace_function == "app/steady"} == {"pirate"}
    assert {r.function for r in work.requests if r.trace_function == "app/burst"} <= {"haiku", "french"}
    assert all(r.prompt_tokens in (100, 512) and r.output_tokens in (10, 64) for r in work.requests)
    again = workload_from_minute_counts(
        [_row("steady", STEADY[:3]), _row("burst", [1, 0, 2])],
        mapping,
        TokenSampler([(100, 10), (2000, 300)], random.Random(3), max_prompt_tokens=512, max_output_tokens=64),
        seed=5,
        mode="uniform",
    )
    assert again == work


def test_llm_workload_window_and_compression() -> None:
    t0 = datetime(2023, 11, 16, 18, 0, 0)
    reqs = [LLMRequest(t0 + timedelta(seconds=s), 50 * (i + 1), 5 + i) for i, s in enumerate([0, 30, 61, 125])]
    work = workload_from_llm(reqs, Mapping.parse(["llm=a", "llm=b"]), seed=0)
    assert [r.arrival_s for r in work.requests] == [0, 30, 61, 125]
    assert [(r.prompt_tokens, r.output_tokens) for r in work.requests] == [(50, 5), (100, 6), (150, 7), (200, 8)]
    sliced = work.window(30, 60)
    assert [r.arrival_s for r in sliced.requests] == [0, 31]
    fast = sliced.compressed(2.0)
    assert [r.arrival_s for r in fast.requests] == [0, 15.5] and fast.duration_s == 30.0
    with pytest.raises(InvalidInput, match="speedup is 0"):
        work.compressed(0)
