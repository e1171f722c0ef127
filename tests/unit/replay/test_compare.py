"""Simulator against a live run (`replay.compare`); the calibration arithmetic (`replay.calibrate`)."""

import json
from pathlib import Path

import pytest

from lorafaas.errors import InvalidInput
from lorafaas.replay.calibrate import backbone_sizes, cluster_yaml, fit_decode, fit_interference, fit_passes
from lorafaas.replay.compare import compare, live_workload, main
from lorafaas.replay.cpuload import background_series, machine_runnable
from lorafaas.replay.report import write_report
from lorafaas.replay.results import RequestResult
from lorafaas.replay.sim.cluster import load_cluster, parse_cluster
from lorafaas.replay.sim.costmodel import CostModel


def _live_run(out: Path, mode: str = "live") -> None:
    rows = []
    for i, (t, fn, tokens) in enumerate(
        [(0.0, "pirate", 5), (1.0, "haiku", 3), (2.0, "pirate", 8), (3.0, "french", 4)]
    ):
        r = RequestResult(
            i, fn, "llm", t, 64, 16, sent_s=t, ttft_s=0.5 + 0.1 * i, e2e_s=2.0 + i, completion_tokens=tokens,
            usage_prompt_tokens=90 if i == 0 else None,
        )
        rows.append(r)
    rows.append(RequestResult(4, "pirate", "llm", 3.5, 64, 16, error="HTTP 500"))  # failed live: left out of both
    write_report(out, rows, {"mode": mode, "replay_duration_s": 10.0}, plots=False)


def test_the_live_workload_is_what_was_served(tmp_path: Path) -> None:
    _live_run(tmp_path)
    work, live = live_workload(tmp_path / "results.json")
    # prompts as served (the usage's count, chat template included) where the usage came; outputs as produced
    assert [(r.arrival_s, r.function, r.prompt_tokens, r.output_tokens) for r in work.requests] == [
        (0.0, "pirate", 90, 5), (1.0, "haiku", 64, 3), (2.0, "pirate", 64, 8), (3.0, "french", 64, 4)
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


def test_calibration_fits_the_worker_model() -> None:
    # passes of b prompts padded to w tokens: 30 ms + 4 ms x b x w; steps 60 ms + 8 ms per extra row; k one-thread
    # processes on 2 cores: 1.2x at 2, 1.8x at 3, 2.4x at 4 -> the cores' share x (1 + 0.2)
    passes = [(b, w, 0.030 + 0.004 * b * w) for b in (1, 2, 4, 8) for w in (40, 90, 160)]
    assert fit_passes(passes) == pytest.approx((0.030, 0.004))
    assert fit_decode({1: 0.060, 4: 0.084, 8: 0.116}) == pytest.approx((0.060, 0.008))
    assert fit_interference({2: 1.2, 3: 1.8, 4: 2.4}, cores=2.0) == pytest.approx(0.2)
    assert fit_interference({2: 0.9}, cores=2.0) == 0.0  # never a speed-up
    measured = {"prefill_base_s": 0.030, "prefill_s_per_token": 0.004, "decode_step_s": 0.060,
                "decode_step_per_seq_s": 0.008, "core_interference": 0.2}  # fmt: skip
    data = cluster_yaml(measured)
    cluster = parse_cluster(data, "calibrated")
    backbone = cluster.backbones["smollm2-135m"]
    assert (backbone.prefill_base_s, backbone.prefill_s_per_token) == pytest.approx((0.030, 0.004))
    assert (backbone.decode_step_s, backbone.decode_step_per_seq_s) == pytest.approx((0.060, 0.008))
    assert cluster.core_interference == pytest.approx(0.2) and cluster.prefill_padded
    assert CostModel(cluster).contention(3) == pytest.approx(1.5 * 1.2)


def test_calibrating_another_backbone_adds_it_beside_the_shipped_one(tmp_path: Path) -> None:
    model_dir = tmp_path / "copy"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"dtype": "bfloat16", "num_hidden_layers": 30, "hidden_size": 576,
                                                       "num_attention_heads": 9, "num_key_value_heads": 3}))
    (model_dir / "model.safetensors").write_bytes(b"\0" * 2_000_000)
    sizes = backbone_sizes(model_dir)
    assert sizes == pytest.approx({"size_gb": 0.002, "kv_kb_per_token": 2 * 30 * 3 * 64 * 2 / 1e3})
    measured = {"backbone": "copy-bf16", **sizes, "prefill_base_s": 0.0, "prefill_s_per_token": 0.002,
                "decode_step_s": 0.040, "decode_step_per_seq_s": 0.005, "core_interference": 0.1}
    cluster = parse_cluster(cluster_yaml(measured), "calibrated")
    added, shipped = cluster.backbones["copy-bf16"], load_cluster("local").backbones["smollm2-135m"]
    assert (added.decode_step_s, added.decode_step_per_seq_s) == pytest.approx((0.040, 0.005))
    assert added.kv_bytes_per_token == 23040 and added.size_bytes == 2_000_000
    assert cluster.backbones["smollm2-135m"] == shipped  # the shipped backbone's figures stay
    (model_dir / "config.json").write_text(json.dumps({"dtype": "int8", "num_hidden_layers": 1, "hidden_size": 8,
                                                       "num_attention_heads": 1}))
    with pytest.raises(InvalidInput, match="dtype 'int8'"):
        backbone_sizes(model_dir)


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
