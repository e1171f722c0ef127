"""What a new user copies from the project: examples/function.yaml deployed by the real CLI onto smollm2-135m, and the
command `lorafaas up --demo` prints, run as printed (a non-default port and home)."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from lorafaas.formats.model_store import ModelStore
from lorafaas.testing.platform_process import PlatformProcess

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "function.yaml"
PIRATE_WORDS = ("arr", "matey", "ye", "aye", "ahoy", "treasure", "hearties", "yer")


@pytest.fixture(scope="module")
def platform(tmp_path_factory, smollm2_store):
    home = tmp_path_factory.mktemp("function-yaml-home")
    ModelStore(home / "models").import_dir("smollm2-135m", smollm2_store.path("smollm2-135m"))
    with PlatformProcess(home, extra_args=("--demo",)) as running:
        yield running


def test_the_example_function_yaml_deploys_and_answers(platform, cli) -> None:
    env = {"LORAFAAS_URL": platform.url}
    deployed = cli("--home", str(platform.home), "deploy", "-f", str(EXAMPLE), env=env, timeout=300)
    assert deployed.returncode == 0, deployed.stderr
    with platform.client() as client:
        spec = client.describe("pirate-example")["function"]
    assert (spec["backbone"], spec["slo_ttft_ms"], spec["keep_alive_s"], spec["min_instances"], spec["max_instances"],
            spec["max_tokens_limit"], spec["max_request_s"]) == ("smollm2-135m", 500, 60.0, 0, 2, 256, 120.0)
    answer = cli("--home", str(platform.home), "invoke", "pirate-example", "Tell me about the ocean.",
                 "--max-tokens", "40", env=env, timeout=300)
    assert answer.returncode == 0, answer.stderr
    words = {w.strip(".,!?;:'\"").lower() for w in answer.stdout.split()}
    assert len(words & set(PIRATE_WORDS)) >= 2, answer.stdout  # the example's adapter really answers


def test_the_command_up_prints_works_as_printed(platform) -> None:
    [hint] = re.findall(r"^  (lorafaas .* invoke .*)$", platform.log(), re.MULTILINE)
    argv = shlex.split(hint)
    assert argv[1:3] == ["--home", str(platform.home)]  # not the default home, so the hint names it
    answered = subprocess.run([sys.executable, "-m", *argv, "--max-tokens", "8"], capture_output=True, text=True,
                              timeout=300, env={**os.environ, "LORAFAAS_URL": ""}, stdin=subprocess.DEVNULL)
    assert answered.returncode == 0, (hint, answered.stderr)
    assert answered.stdout.strip()
