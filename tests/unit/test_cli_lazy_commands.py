"""`lorafaas CMD` imports only CMD's module: a user's `lorafaas list` at a fleet of functions does not pay for the
benchmarks, the simulator, the server or torch; the whole app (help, a mistyped command) still knows every command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from lorafaas.cli import COMMANDS, command, root_app

HEAVY = ("torch", "lorafaas.cli.bench", "lorafaas.cli.up", "lorafaas.replay", "lorafaas.platform.server",
         "lorafaas.cli.fleet", "lorafaas.cli.function_file")


def _modules_after(argv: list[str]) -> set[str]:
    probe = (f"import json, sys\nfrom lorafaas.cli import main\ntry:\n    main({argv!r})\n"
             "except SystemExit:\n    pass\nprint(json.dumps(sorted(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("argv", [["list", "--help"], ["--home", "/nonexistent", "describe", "--help"]])
def test_a_platform_command_imports_none_of_the_heavy_modules(argv):
    loaded = _modules_after(argv)
    assert "lorafaas.cli.functions" in loaded
    assert not {m for m in loaded for heavy in HEAVY if m == heavy or m.startswith(heavy + ".")}


def test_the_whole_app_has_every_command_and_a_typo_is_answered_with_suggestions():
    assert set(command().commands) == set(COMMANDS)
    result = CliRunner().invoke(root_app(), ["lst"])
    assert result.exit_code == 2 and "'list'" in result.output


def test_one_command_app_runs_like_the_whole_one():
    whole = CliRunner().invoke(root_app(), ["list", "--help"])
    alone = CliRunner().invoke(root_app(["list"]), ["list", "--help"])
    assert whole.exit_code == alone.exit_code == 0 and whole.output == alone.output
