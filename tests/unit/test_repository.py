"""Repository-level guarantees: the package does not shadow the standard library, and the code is lint-clean."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_import_platform_from_repo_root_is_the_stdlib_module() -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import platform; print(platform.system()); print(platform.__file__)"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    system, origin = result.stdout.splitlines()
    assert system == "Linux"
    assert not Path(origin).resolve().is_relative_to(REPO_ROOT)


def test_ruff_is_clean() -> None:
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (it comes with the dev extra)")
    result = subprocess.run([ruff, "check", "."], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
