"""`lorafaas backbone serve` in the foreground and `lorafaas bench attach --json` against it (tiny-dense)."""

from __future__ import annotations

import json
import selectors
import signal
import subprocess
import sys

import pytest
import torch

from lorafaas.cli import main
from lorafaas.cuda_ipc.shm import list_segments, unlink_segment
from lorafaas.formats.model_store import ModelStore
from lorafaas.protocols.daemon_config import DaemonConfig

BACKBONE = "tiny-dense"
BENCH_KEYS = {"backbone", "bytes", "private_load_s", "attach_s", "bind_s", "ratio_private_over_attach"}


def _run_cli(argv: list[str]) -> int:
    try:
        main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def _read_line(process: subprocess.Popen, timeout_s: float) -> str:
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    assert selector.select(timeout_s), f"`backbone serve` printed nothing within {timeout_s} s"
    return process.stdout.readline().decode().strip()


def test_serve_prints_its_socket_and_bench_attach_measures_against_it(tmp_path_factory, tiny_dense_dir, capsys):
    home = tmp_path_factory.mktemp("bh")
    store = ModelStore(home / "models")
    store.import_dir(BACKBONE, tiny_dense_dir)
    paths = DaemonConfig(home=home, backbone=BACKBONE).paths
    with (home / "serve.log").open("ab") as log:
        serve = subprocess.Popen(
            [sys.executable, "-c", "from lorafaas.cli import main; main()", "--home", str(home), "backbone",
             "serve", BACKBONE], stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
        )
    try:
        assert _read_line(serve, 120) == str(paths.socket)
        capsys.readouterr()
        code = _run_cli(["--home", str(home), "bench", "attach", "--backbone", BACKBONE, "--repeats", "1", "--json"])
        out = capsys.readouterr().out
        assert code == 0, out
        result = json.loads(out)
        assert set(result) == BENCH_KEYS
        assert result["backbone"] == BACKBONE and result["bytes"] == store.get(BACKBONE).bytes
        assert 0 < result["bind_s"] < result["attach_s"]
        assert result["private_load_s"] > 0
        assert result["ratio_private_over_attach"] == pytest.approx(result["private_load_s"] / result["attach_s"])
        assert serve.poll() is None  # the bench used the running daemon and left it running
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(60) == 0
        assert list_segments(paths.segment_prefix) == []  # SIGTERM is a clean stop
        assert not paths.socket.exists()
    finally:
        if serve.poll() is None:
            serve.kill()
        serve.wait()
        serve.stdout.close()
        for name in list_segments(paths.segment_prefix):
            unlink_segment(name)


def test_serving_a_backbone_that_is_not_in_the_store_exits_2(tmp_path, capsys) -> None:
    assert _run_cli(["--home", str(tmp_path), "backbone", "serve", "absent"]) == 2
    assert "absent" in capsys.readouterr().err


def test_serving_on_a_device_without_its_transport_exits_2_before_loading(tmp_path, tiny_dense_dir, capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is present here: cuda:0 is a valid device")
    ModelStore(tmp_path / "models").import_dir(BACKBONE, tiny_dense_dir)
    assert _run_cli(["--home", str(tmp_path), "backbone", "serve", BACKBONE, "--device", "cuda:0"]) == 2
    assert "cuda:0 needs CUDA" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before taking the lock or creating anything
