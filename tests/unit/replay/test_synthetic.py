"""Synthetic 2019-format traces: seeded, in the requested classes, readable by the real parser."""

from pathlib import Path

import pytest

from lorafaas.errors import InvalidInput
from lorafaas.replay.synthetic import generate, write_2019_invocations
from lorafaas.replay.traces import iter_2019_invocations
from lorafaas.replay.workload import stats_2019


def test_classes_seed_and_format(tmp_path: Path) -> None:
    wanted = {"predictable": 3, "normal": 3, "bursty": 3}
    path = write_2019_invocations(tmp_path / "inv.csv", generate(wanted, 120, seed=4), 120)
    stats = stats_2019(iter_2019_invocations(path))
    assert sorted(s.trace_class for s in stats) == sorted(c for c, n in wanted.items() for _ in range(n))
    assert all(s.key.split("/")[1].split("-")[1] == s.trace_class for s in stats)
    again = write_2019_invocations(tmp_path / "again.csv", generate(wanted, 120, seed=4), 120)
    assert again.read_text() == path.read_text()
    with pytest.raises(InvalidInput, match="minutes is 2000"):
        list(generate(wanted, 2000, seed=4))
