"""`lorafaas bench hostile` on the tiny backbone, through the real command line: every attack of issue 36 is run and
reported, and what the benchmark claims holds (outputs equal alone, the attacker evicted or refused and served
nothing, no honest member hung up on); its figures are not checked."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from lorafaas.bench.hostile import ATTACKS
from lorafaas.formats.model_store import ModelStore


@pytest.mark.timeout(900)  # 11 runs of fresh member processes: 88 s at load 3, 333 s at load 9 on two cores
def test_bench_hostile_reports_every_attack_and_its_invariants(tmp_path, tiny_dense_dir, cli) -> None:
    ModelStore(tmp_path / "models").import_dir("tiny-dense", tiny_dense_dir)
    result = cli("--home", str(tmp_path), "bench", "hostile", "--backbone", "tiny-dense", "--steps", "3", "--json",
                 timeout=840)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["backbone"] == "tiny-dense" and report["members"] == 2 and report["steps"] == 3
    assert report["limit"] == 1.5 and len(report["member_tpot_alone_s"]) == 2
    assert len(report["calm_runs_tpot_s"]) == len(ATTACKS)  # a calm run before each attack, its baseline
    assert report["tpot_alone_s"] > 0 and report["tpot_calm_s"] > 0 and report["calm_outputs_equal_alone"]
    rows = {row["attack"]: row for row in report["attacks"]}
    assert list(rows) == list(ATTACKS) and [row["finding"] for row in report["attacks"]] == [1, 2, 3, 4, 5]
    for name, row in rows.items():
        assert row["outputs_equal_alone"] and row["outputs_equal_calm"], name
        assert row["honest_kept"], (name, row["daemon_said"])
        assert row["attacker_served"] == 0, (name, row["attacker"])
        assert len(row["member_tpot_s"]) == len(row["member_calls"]) == 2
        assert row["attack_s"] > 0 and row["attacker_cpu_s"] >= 0
        assert row["over_calm"] == row["tpot_s"] / row["calm_tpot_s"]
        assert row["within_limit_of_calm"] == (row["over_calm"] <= 1.5)
        assert row["within_limit_of_alone"] == (row["over_alone"] <= 1.5)
    for name in ("lm-head-flood", "sealed-buffer", "bogus-groups"):  # hung up on or refused, by the daemon's log
        assert rows[name]["attacker_evicted"], (name, rows[name])
    flood = rows["lm-head-flood"]["attacker"]
    assert flood["welcomed"] >= 1 and flood["hung_up"] >= 1 and flood["served"] == 0
    assert rows["sealed-buffer"]["attacker"]["hellos"] >= 1 and rows["bogus-groups"]["attacker"]["hellos"] >= 1
    assert rows["idle-active"]["attacker"]["ends"] >= 1
    proc = rows["proc-fd"]["attacker"]
    assert proc["probes"] >= 1 and proc["fds_listed"] >= 1  # it saw the daemon's descriptors and opened none
    if os.geteuid() != 0 or shutil.which("capsh"):  # the probe could open a dumpable process of its kind
        assert proc["meaningful"] == 1 and proc["control_opened"] >= 1
