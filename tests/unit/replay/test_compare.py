"""Simulator against a live run (`replay.compare`); the calibration arithmetic (`replay.calibrate`)."""

import json
from pathlib import Path

import pytest
import yaml

from lorafaas.replay.calibrate import cluster_yaml, derive
from lorafaas.replay.compare import compare, live_workload, main
from lorafaas.replay.cpuload import background_series, machine_runnable
from lorafaas.replay.report import write_report
from lorafaas.replay.results import RequestResult
from lorafaas.replay.sim.cluster import parse_cluster

SHIPPED = yaml.safe_load((Path(__file__).resolve().parents[3] / "lorafaas/replay/clusters/local.yaml").read_text())


def _live_run(out: Path, mode: str = "live") -> None:
    rows = []
    for i, (t, fn, tokens) in enumerate(
        [(0.0, "pirate", 5), (1.0, "haiku", 3), (2.0, "pirate", 8), (3.0, "french", 4)]
    ):
        r = RequestResult(
            i, fn, "llm", t, 64, 16, sent_s=t, ttft_s=0.5 + 0.1 * i, e2e_s=2.0 + i, completion_tokens=tokens
        )
        rows.append(r)
    rows.append(RequestResult(4, "pirate", "llm", 3.5, 64, 16, error="HTTP 500"))  # failed live: left out of both
    write_report(out, rows, {"mode": mode, "replay_duration_s": 10.0}, plots=False)


def test_the_live_workload_is_what_was_served(tmp_path: Path) -> None:
    _live_run(tmp_path)
    work, live = live_workload(tmp_path / "results.json")
    assert [(r.arrival_s, r.function, r.prompt_tokens, r.output_tokens) for r in work.requests] == [
        (0.0, "pirate", 64, 5), (1.0, "haiku", 64, 3), (2.0, "pirate", 64, 8), (3.0, "french", 64, 4)
    ]  # fmt: skip
    assert work.duration_s == 10.0 and len(live) == 4


def test_compare_reports_both_means_and_the_relative_difference(tmp_path: Path, capsys) -> None:
    _live_run(tmp_path)
    result = compare(tmp_path, "local", "lorafaas")
    ttft = result["metrics"]["ttft_s"]
    assert ttft["live_mean"] == pytest.approx((0.5 + 0.6 + 0.7 + 0.8) / 4)
    assert ttft["relative_difference"] == pytest.approx((ttft["sim_mean"] - ttft["live_mean"]) / ttft["live_mean"])
    assert result["metrics"]["e2e_s"]["live_mean"] == pytest.approx(3.5)
    assert main([str(tmp_path)]) == 0
    assert "| E2E | 3.500 |" in capsys.readouterr().out


def test_compare_refuses_what_is_not_a_live_run(tmp_path: Path, capsys) -> None:
    _live_run(tmp_path, mode="simulated")
    assert main([str(tmp_path)]) == 2
    assert "mode is 'simulated'; compare needs a live run" in capsys.readouterr().err
    assert main([str(tmp_path / "missing")]) == 2
    assert "not a live replay's results.json" in capsys.readouterr().err


def test_calibration_from_bench_figures() -> None:
    # one instance: a 1-token request takes 0.4 s (its prefill); 33 tokens one at a time at 6.6 tokens/s = 5 s each,
    # so 32 decode steps of (5 - 0.4) / 32 = 0.14375 s; all 8 at once at 20 tokens/s = 13.2 s = 8 x 0.4 + 32 x 0.3125
    # two instances at once: each 5.5 tokens/s (slowdown 1.2); four: 3.3 (slowdown 2.0) -> c = (0.2 + 3) / (1 + 9)
    results = {(1, 1): [{"tokens_per_s_at_1": 2.5}], (33, 1): [{"tokens_per_s_at_1": 6.6, "tokens_per_s_at_n": 20.0}],
               (33, 2): [{"tokens_per_s_at_1": 5.5}] * 2, (33, 4): [{"tokens_per_s_at_1": 3.3}] * 4}  # fmt: skip
    measured = derive(results, (2, 4), json.loads(json.dumps(SHIPPED)))
    assert measured["decode_step_1_s"] == pytest.approx(0.14375)
    assert measured["decode_step_8_s"] == pytest.approx(0.3125)
    assert measured["slowdowns"] == pytest.approx({2: 1.2, 4: 2.0})
    assert measured["contention"] == pytest.approx(0.32)
    data = cluster_yaml(measured)
    backbone = data["backbones"]["smollm2-135m"]
    assert backbone["decode_ms_per_step"] == pytest.approx(143.8)
    assert backbone["decode_ms_per_extra_seq"] == pytest.approx((312.5 - 143.75) / 7, abs=0.01)
    ratio = measured["prefill_ratio"]
    assert backbone["prefill_base_ms"] == pytest.approx(SHIPPED["backbones"]["smollm2-135m"]["prefill_base_ms"] * ratio,
                                                        abs=0.1)  # fmt: skip
    assert parse_cluster(data, "calibrated").contention == pytest.approx(0.32)


def test_cpu_load_background_is_what_runs_besides_the_workers(tmp_path: Path) -> None:
    samples = [[0.0, 5, 1], [2.5, 3, 1], [5.0, 2, 2], [7.5, 6, 2]]
    assert background_series({"samples": samples}, window_s=5.0) == [(0.0, 3.0), (5.0, 2.0)]
    assert machine_runnable() >= 0  # this machine's /proc/stat parses
    # compare with a cpu-load file: the simulated device shares its cores with that background
    _live_run(tmp_path)
    (tmp_path / "cpuload.json").write_text(json.dumps({"samples": [[0.0, 9, 0]]}))
    loaded = compare(tmp_path, cpu_load=tmp_path / "cpuload.json")
    quiet = compare(tmp_path)
    assert loaded["background_threads_mean"] == 9.0
    assert loaded["metrics"]["e2e_s"]["sim_mean"] > 3 * quiet["metrics"]["e2e_s"]["sim_mean"]
    (tmp_path / "bad.json").write_text("{}")
    assert main([str(tmp_path), "--cpu-load", str(tmp_path / "bad.json")]) == 2
