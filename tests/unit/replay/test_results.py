"""Request outcomes: TPOT, percentiles, summaries, cold-start attribution, report files."""

import json

import pytest

from lorafaas.replay.live import InstanceSeen, attribute_cold_starts, prompt_text
from lorafaas.replay.report import write_report
from lorafaas.replay.results import RequestResult, percentile, summarize


def _done(i: int, fn: str, arrival: float, ttft: float, e2e: float, tokens: int) -> RequestResult:
    return RequestResult(i, fn, "t", arrival, 10, 8, sent_s=arrival, ttft_s=ttft, e2e_s=e2e, completion_tokens=tokens)


def test_tpot_percentile_summary() -> None:
    a = _done(0, "a", 0.0, 0.5, 1.5, 5)
    assert a.tpot_s == pytest.approx(0.25)
    assert _done(1, "a", 0.0, 0.5, 0.5, 1).tpot_s is None
    failed = RequestResult(2, "b", "t", 1.0, 10, 8, error="HTTP 503")
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5 and percentile([], 50) is None
    s = summarize([a, _done(1, "a", 1.0, 1.5, 2.0, 1), failed])
    assert [x.function for x in s] == ["a", "b", "all"]
    assert s[0].ttft_s.mean == pytest.approx(1.0) and s[0].num_ok == 2
    assert s[1].num_errors == 1 and s[1].ttft_s.mean is None
    assert s[2].num_requests == 3 and s[2].num_ok == 2


def test_cold_start_attribution() -> None:
    # a0 waits when instance i1 starts at 0.1 s; a1 (sent at 2.0) is served warm; a2 waits when i2 starts at 5.05
    rs = [
        _done(0, "a", 0.0, 1.0, 2.0, 3),
        _done(1, "a", 2.0, 0.1, 0.5, 3),
        _done(2, "a", 5.0, 0.8, 1.0, 3),
        _done(3, "b", 0.0, 0.1, 0.2, 3),
    ]
    instances = {"i1": InstanceSeen("i1", "a", 100.1, {"total": 0.9}), "i2": InstanceSeen("i2", "a", 105.05, {})}
    attribute_cold_starts(rs, instances, started_wall=100.0)
    assert [r.cold for r in rs] == [True, False, True, False]
    assert rs[0].cold_start_s == 0.9


def test_prompt_length_and_report(tmp_path) -> None:
    assert len(prompt_text(100).split()) == 3 + 92
    rs = [_done(0, "a", 0.0, 0.5, 1.5, 5), RequestResult(1, "a", "t", 1.0, 10, 8, error="boom")]
    write_report(tmp_path, rs, {"trace": "x.csv"}, {"a": [{"spawn": 0.1, "load": 0.2, "total": 0.3}]})
    assert {p.name for p in tmp_path.iterdir()} == {
        "results.json",
        "requests.csv",
        "summary.md",
        "ttft_cdf.png",
        "latency_over_time.png",
        "cold_starts.png",
    }
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["summary"][-1]["num_errors"] == 1
    assert "`boom`" in (tmp_path / "summary.md").read_text()
