"""`lorafaas bench server-start` against real server processes on loopback: a server that listens only after a
delay and leaves a child in a session of its own, and servers that fail to start."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from lorafaas.bench.server_start import ServerStartConfig, ServerStartTarget, run_server_start_bench
from lorafaas.cli import app
from lorafaas.testing.platform_process import free_port

SERVER = str(Path(__file__).with_name("slow_start_server.py"))
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _servers_import_this_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test server imports `lorafaas.testing`: this tree's, installed or not."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def slow_server(label: str, delay_s: float, tmp_path: Path, model: str = "m") -> tuple[ServerStartTarget, Path]:
    port, pidfile = free_port(), tmp_path / f"{label}.child"
    command = (sys.executable, SERVER, str(port), str(delay_s), str(pidfile))
    return ServerStartTarget(label=label, url=f"http://127.0.0.1:{port}", model=model, command=command), pidfile


def test_the_first_token_is_timed_from_the_launch_and_the_whole_tree_is_stopped(tmp_path: Path) -> None:
    slow, slow_child = slow_server("slow", 1.5, tmp_path)
    quick, quick_child = slow_server("quick", 0.0, tmp_path)
    config = ServerStartConfig(repeats=2, output_len=4, settle_s=0.0, poll_s=0.1, log_dir=str(tmp_path / "logs"))
    result = run_server_start_bench([slow, quick], config)
    assert [s.label for s in result.samples] == ["slow", "quick", "quick", "slow"]  # alternated
    by_label = {s.label: s for s in result.summaries}
    assert by_label["slow"].min_first_token_s >= 1.5  # it listened only after its delay
    assert all(s.attempts > 1 for s in result.samples if s.label == "slow")  # refused while starting
    assert by_label["slow"].median_first_token_s > by_label["quick"].median_first_token_s
    for pidfile in (slow_child, quick_child):  # the last sample's child, in a session of its own, is gone too
        assert not psutil.pid_exists(int(pidfile.read_text())) or \
            psutil.Process(int(pidfile.read_text())).status() == psutil.STATUS_ZOMBIE
    assert all(Path(s.log).is_file() for s in result.samples)


def test_a_server_that_exits_or_never_serves_the_model_is_an_error_naming_it(tmp_path: Path) -> None:
    config = ServerStartConfig(repeats=1, settle_s=0.0, poll_s=0.1, timeout_s=5.0, log_dir=str(tmp_path))
    dead = ServerStartTarget(label="dead", url="http://127.0.0.1:9", model="m",
                             command=(sys.executable, "-c", "print('no GPU'); raise SystemExit(3)"))
    with pytest.raises(RuntimeError, match=r"dead: the server exited with code 3 .*dead-1.log"):
        run_server_start_bench([dead], config)
    assert "no GPU" in (tmp_path / "dead-1.log").read_text()
    wrong, _ = slow_server("wrong", 0.0, tmp_path, model="not-served")
    with pytest.raises(RuntimeError, match=r"wrong: no first token within 5 s \(last answer: HTTP 404"):
        run_server_start_bench([wrong], config)


@pytest.mark.parametrize(("args", "message"), [
    (["--url", "a=http://127.0.0.1:1", "--command", "b=true", "--model", "a=m"], "differ from --url"),
    (["--url", "a=http://127.0.0.1:1", "--command", "a=", "--model", "a=m"], "expected label=value"),
    (["--url", "a=127.0.0.1:1", "--command", "a=true", "--model", "a=m"], "http"),
    (["--url", "a=http://127.0.0.1:1", "--command", "a='unclosed", "--model", "a=m"], "quotation"),
])
def test_bad_options_exit_2_naming_the_option(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["bench", "server-start", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
