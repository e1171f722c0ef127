"""Defects that `python -m mypy` found (issue 37 item 4): each test failed before its fix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lorafaas.errors import ClusterInvalid
from lorafaas.replay.sim.cluster import parse_cluster


@pytest.mark.parametrize("backbones", [["b"], "b"])
def test_a_cluster_whose_backbones_are_not_a_mapping_is_refused_by_name(backbones: object) -> None:
    # Was AttributeError ('list' object has no attribute 'items') instead of the cluster's own error.
    with pytest.raises(ClusterInvalid, match=r"c\.backbones is .*expected a mapping"):
        parse_cluster({"backbones": backbones}, "c")


def test_a_cluster_whose_functions_are_not_a_list_is_refused_by_name() -> None:
    backbone = {"size_gb": 1, "prefill_base_ms": 1, "prefill_ms_per_token": 1, "decode_ms_per_step": 1,
                "decode_ms_per_extra_seq": 1, "kv_kb_per_token": 1}
    with pytest.raises(ClusterInvalid, match=r"c\.functions is .*expected a list"):
        parse_cluster({"backbones": {"b": backbone}, "functions": {"f": {}}}, "c")


def test_requires_python_is_the_python_mypy_checks_against() -> None:
    # Was ">=3.10" while the package uses datetime.UTC, asyncio.timeout and Task.uncancel (3.11): mypy run for 3.10
    # reported them, and `import lorafaas.platform.usage` fails on 3.10.
    text = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    requires = re.search(r'^requires-python = ">=([0-9.]+)"', text, re.MULTILINE)
    checked = re.search(r'^python_version = "([0-9.]+)"', text, re.MULTILINE)
    assert requires is not None and checked is not None
    assert requires.group(1) == checked.group(1)
