"""scripts/gpu-check.sh --dry-run: the GPU check's wheels install for CPython 3.12 and every step runs end to end on
the CPU (tiny shapes of the same families, host memory standing in for NVML), with the figures its report promises.

The wheels come from scripts/gpu-wheels.sh (.ci/run makes them; LORAFAAS_REQUIRE_GPU_WHEELS=1 there, so CI never
skips this)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_the_gpu_check_dry_run_passes_every_step_with_its_figures(tmp_path: Path) -> None:
    if not list((REPO / ".whl").glob("*.whl")):
        if os.environ.get("LORAFAAS_REQUIRE_GPU_WHEELS"):
            pytest.fail("no wheels in .whl/: scripts/gpu-wheels.sh did not run")
        pytest.skip("no wheels in .whl/ (run scripts/gpu-wheels.sh)")
    report_path = tmp_path / "gpu-check.json"
    # a short scratch path: the daemons' Unix sockets live under it (108 bytes at most for a socket's path)
    work = Path(tempfile.mkdtemp(prefix="gc-", dir="/tmp"))
    try:
        result = subprocess.run(["bash", "scripts/gpu-check.sh", "--dry-run", "--work", str(work), "--json",
                                 str(report_path)], cwd=REPO, capture_output=True, text=True, timeout=900,
                                stdin=subprocess.DEVNULL)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-4000:]
    assert "wheels install for CPython 3.12" in result.stdout
    assert "| platform | pass |" in result.stdout  # the summary table
    report = json.loads(report_path.read_text())
    steps = {step["name"]: step for step in report["steps"]}
    assert list(steps) == ["env", "cuda_tier", "synthesize", "platform", "read_only", "bind_time"]
    assert all(step["ok"] for step in steps.values()), {n: s["summary"] for n, s in steps.items()}

    platform = steps["platform"]["figures"]
    for dtype in ("float32", "bfloat16"):  # 3 functions x 4 prompts, each against PEFT
        assert platform["exactness"][dtype]["alone"] == "12/12"
        assert platform["exactness"][dtype]["in_flight_8"] == "12/12"
    zero = platform["zero_copy"]
    assert zero["eight_functions"] >= zero["one_function"] > 0 and len(zero["per_process"]) >= 9
    for level in ("1", "4"):  # both servers answered every request at every level
        assert {"lorafaas", "peft", "ratio"} <= set(platform["speed"][level])
        assert platform["speed"][level]["lorafaas"]["failed"] == platform["speed"][level]["peft"]["failed"] == 0
    assert platform["new_function"]["first_token_s"] > 0
    assert platform["attach"]["map_ms"] > 0
    assert platform["faults"]["recovered_s"] is not None
    assert all(platform["verdicts"].values())
    assert steps["read_only"]["figures"]["writer_exit"] != 0
    assert steps["read_only"]["figures"]["reader_logits_unchanged"]
    assert len(steps["bind_time"]["figures"]) == 3
    assert all(f["map_ms"] > 0 and f["bind_ms"] > 0 for f in steps["bind_time"]["figures"].values())
