"""The layer map in `.importlinter` holds, and it is not vacuous: an upward import, a cycle or a scheduler import of
torch, added to a copy of the package, each break it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")


def lint_imports(package_parent: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    return subprocess.run([LINT_IMPORTS, "--config", str(REPO / ".importlinter"), "--no-cache"], cwd=package_parent,
                          env=env, capture_output=True, text=True, timeout=300)


def test_every_import_points_down_and_no_cycle_remains() -> None:
    run = lint_imports(REPO)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "3 kept, 0 broken" in run.stdout


@pytest.mark.parametrize(("module", "added", "broken"), [
    ("function_runtime/engine.py", "import lorafaas.platform.service", "lorafaas.function_runtime is not allowed to "
     "import lorafaas.platform"),
    ("function_runtime/worker.py", "import lorafaas.backbone_daemon.server", "lorafaas.function_runtime is not allowed "
     "to import lorafaas.backbone_daemon"),
    ("formats/model_store.py", "import lorafaas.models.binding", "lorafaas.formats is not allowed to import "
     "lorafaas.models"),
    ("scheduler/knapsack.py", "import torch", "The scheduler is pure policy"),
    ("replay/sim/worker.py", "import lorafaas.replay.sim.engine", "No cycles are allowed in lorafaas.replay.sim"),
], ids=["runtime-imports-platform", "runtime-imports-daemon", "formats-import-models", "scheduler-imports-torch",
        "module-cycle"])
def test_a_deliberate_violation_breaks_the_contracts(tmp_path, module: str, added: str, broken: str) -> None:
    shutil.copytree(REPO / "lorafaas", tmp_path / "lorafaas", ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "lorafaas" / module
    target.write_text(target.read_text() + f"\n{added}  # a deliberate violation\n")
    run = lint_imports(tmp_path)
    assert run.returncode != 0, run.stdout[-3000:]
    assert broken in run.stdout, run.stdout[-3000:]
