"""`lorafaas bench load` on a small synthetic file: the fields it reports and the invariants it claims (every tier
against a limit measured beside it; the cold run's drop checked, not assumed; its scratch file removed), not its
figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from lorafaas.bench.load import drop_from_cache, resident_fraction, write_synthetic_file


def test_bench_load_reports_every_tier_beside_its_limit(tmp_path: Path) -> None:
    scratch = set(Path(tempfile.gettempdir()).glob("lorafaas-bench-load-*"))
    result = subprocess.run([sys.executable, "-m", "lorafaas", "--home", str(tmp_path), "bench", "load",
                             "--size-mb", "8", "--repeats", "1", "--json"],
                            capture_output=True, text=True, timeout=300, check=True)
    document = json.loads(result.stdout)
    assert document["source"] == "synthetic" and document["bytes_loaded"] >= 8 * 1024 * 1024 * 0.99
    assert 0.0 <= document["cold_resident_fraction"] <= 1.0
    assert document["cold_dropped"] == (document["cold_resident_fraction"] < 0.05)
    for tier in ("cold", "page_cache", "host_tier"):
        row = document[tier]
        assert row["loader_gbps"] > 0 and row["limit_gbps"] > 0 and row["new_memory_limit_gbps"] > 0
        assert abs(row["fraction_of_limit"] - row["loader_gbps"] / row["limit_gbps"]) < 0.01
        assert row["fill_gbps"] > 0
        assert (row["safetensors_gbps"] is None) == (tier == "host_tier")
    assert document["host_tier_adoption_ms"] >= 0
    assert set(Path(tempfile.gettempdir()).glob("lorafaas-bench-load-*")) == scratch  # its synthetic file went


def test_a_dropped_file_is_seen_out_of_the_page_cache(tmp_path: Path) -> None:
    path = write_synthetic_file(tmp_path / "w.safetensors", 4 * 1024 * 1024)
    path.read_bytes()  # cached now
    fd = os.open(path, os.O_RDONLY)
    try:
        assert resident_fraction(fd, os.fstat(fd).st_size) > 0.9
    finally:
        os.close(fd)
    assert drop_from_cache([path]) < 0.05
