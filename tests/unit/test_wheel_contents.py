"""The kubelet emulation behind the Kubernetes tests is test code: it lives in tests/support/ and the wheel does not
ship it. The packages are found here the way the wheel's build finds them (pyproject's
`[tool.setuptools.packages.find]`, through setuptools' own finder)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

from setuptools.discovery import PackageFinder

REPO = Path(__file__).resolve().parents[2]
KUBELET_EMULATION = ("fake_kubelet", "process_kubelet", "pod_network", "pod_volumes", "service_proxy", "k8s_cluster")


def shipped_modules() -> set[str]:
    """Every module the wheel holds: the packages pyproject's find config selects, and the .py files in each."""
    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = PackageFinder.find(str(REPO), exclude=tuple(find.get("exclude", ())),
                                  include=tuple(find.get("include", ("*",))))
    modules = set(packages)
    for package in packages:
        directory = REPO.joinpath(*package.split("."))
        modules.update(f"{package}.{path.stem}" for path in directory.glob("*.py") if path.stem != "__init__")
    return modules


def test_the_wheel_holds_lorafaas_and_no_test_code() -> None:
    modules = shipped_modules()
    assert "lorafaas" in modules and "lorafaas.testing.tiny_models" in modules  # the finder sees the package
    assert not {m for m in modules if m == "tests" or m.startswith("tests.")}


@pytest.mark.parametrize("name", KUBELET_EMULATION)
def test_the_kubelet_emulation_is_not_shipped(name: str) -> None:
    assert not {m for m in shipped_modules() if m.rsplit(".", 1)[-1] == name}
    assert importlib.util.find_spec(f"lorafaas.testing.{name}") is None
    assert importlib.util.find_spec(f"tests.support.{name}") is not None  # where the tests find it
