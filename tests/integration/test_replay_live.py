"""`lorafaas replay` against a real platform process on the tiny backbone: a few requests, small max_tokens."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lorafaas.formats.model_store import ModelStore
from lorafaas.testing.platform_process import PlatformProcess
from lorafaas.testing.tiny_models import save_tiny_adapter

TRACE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:00.0000000,40,4
2023-11-16 18:17:00.2000000,900,3
2023-11-16 18:17:00.4000000,20,6
2023-11-16 18:17:01.0000000,30,2
2023-11-16 18:17:01.5000000,60,5
2023-11-16 18:17:02.0000000,10,4
2023-11-16 18:17:30.0000000,10,4
"""


@pytest.fixture(scope="module")
def platform(tmp_path_factory, tiny_dense_dir):
    home = tmp_path_factory.mktemp("replay-home")
    ModelStore(home / "models").import_dir("tiny-dense", tiny_dense_dir)
    adapters = tmp_path_factory.mktemp("replay-adapters")
    with PlatformProcess(home) as running, running.client() as client:
        for seed, name in enumerate(["alpha", "beta"], start=1):
            client.deploy(
                {"name": name, "backbone": "tiny-dense"},
                save_tiny_adapter(adapters / name, tiny_dense_dir, seed=seed, base_model_name="tiny-dense"),
            )
        yield running


def _replay(platform: PlatformProcess, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LORAFAAS_API_KEY": platform.admin_key, "COLUMNS": "80"}
    return subprocess.run(
        [sys.executable, "-m", "lorafaas", "--home", str(platform.home), "replay", *args, "--url", platform.url],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_replay_writes_the_report(platform: PlatformProcess, tmp_path: Path) -> None:
    trace = tmp_path / "llm.csv"
    trace.write_text(TRACE)
    out = tmp_path / "out"
    done = _replay(
        platform,
        str(trace),
        "--map",
        "llm=alpha",
        "--map",
        "llm=beta",
        "--window",
        "10",
        "--speedup",
        "2",
        "--max-prompt-tokens",
        "64",
        "--max-output-tokens",
        "4",
        "--out",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    for name in ("results.json", "requests.csv", "summary.md", "ttft_cdf.png", "latency_over_time.png"):
        assert (out / name).is_file(), name
    rows = list(csv.DictReader((out / "requests.csv").open()))
    assert len(rows) == 6  # the request at 30 s is outside the 10 s window
    assert {r["function"] for r in rows} <= {"alpha", "beta"}
    assert all(r["error"] == "" for r in rows), [r["error"] for r in rows]
    for r in rows:
        assert 0 < float(r["ttft_s"]) <= float(r["e2e_s"])
        assert int(r["max_tokens"]) <= 4 and int(r["prompt_tokens"]) <= 64
        assert 1 <= int(r["completion_tokens"]) <= int(r["max_tokens"])
    # arrivals compressed by 2: the last one (2.0 s in the trace) at 1.0 s
    assert max(float(r["arrival_s"]) for r in rows) == pytest.approx(1.0)
    # nothing was warm before: each function's first request started an instance
    cold = [r for r in rows if r["cold"] == "True"]
    assert {r["function"] for r in cold} == {r["function"] for r in rows}
    document = json.loads((out / "results.json").read_text())
    assert document["summary"][-1]["function"] == "all"
    assert document["summary"][-1]["num_ok"] == 6
    assert document["cold_start_breakdowns"]
    assert "| all | 6 | 0 |" in (out / "summary.md").read_text()
    # the summary table on stdout is the report's, line for line (Markdown, never wrapped at the width)
    table = [line for line in (out / "summary.md").read_text().splitlines() if line.startswith("| function |")]
    assert table and table[0] in done.stdout.splitlines()
    assert "| all | 6 | 0 |" in done.stdout
    # the platform's own count of instances busy at once, read from /metrics: some, and never more than the two
    # functions could have started
    meta = document["meta"]
    assert meta["compute_slots"] >= 1
    assert 1 <= meta["busy_instances_peak"] <= len({r["function"] for r in rows}) * 4
    # and the step gate's: instances in an engine step at once, never more than the compute slots
    assert 1 <= meta["computing_instances_peak"] <= meta["compute_slots"]


def test_replay_onto_a_missing_function_fails_clearly(platform: PlatformProcess, tmp_path: Path) -> None:
    trace = tmp_path / "llm.csv"
    trace.write_text(TRACE)
    done = _replay(platform, str(trace), "--map", "llm=nosuch", "--out", str(tmp_path / "o"), "--no-plots")
    assert done.returncode == 2
    assert "'nosuch'" in done.stderr and "not deployed" in done.stderr


def test_replay_of_a_malformed_trace_names_the_line(platform: PlatformProcess, tmp_path: Path) -> None:
    trace = tmp_path / "bad.csv"
    trace.write_text(TRACE.replace("30,2", "30,two"))
    done = _replay(platform, str(trace), "--map", "llm=alpha", "--out", str(tmp_path / "o"))
    assert done.returncode == 2
    assert "bad.csv:5:" in done.stderr and "'two'" in done.stderr
