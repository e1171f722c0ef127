"""`lorafaas bench fleet` against a real `lorafaas up` (tiny backbone): a fleet deployed, driven open loop, measured
and deleted; bad options refused with exit 2 and a message."""

from __future__ import annotations

import json

import pytest

from lorafaas.formats.model_store import ModelStore
from lorafaas.testing.platform_process import PlatformProcess


@pytest.fixture(scope="module")
def platform(tmp_path_factory, tiny_dense_dir):
    home = tmp_path_factory.mktemp("bench-fleet-home")
    ModelStore(home / "models").import_dir("tiny-dense", tiny_dense_dir)
    with PlatformProcess(home) as running:
        yield running


def test_bench_fleet_deploys_drives_and_measures_twenty_functions(platform, cli, tmp_path, tiny_dense_dir) -> None:
    """...on the platform and, in the same run, on a second one started `--rank-blind` with the same admin key."""
    blind_home = tmp_path / "rank-blind-home"
    ModelStore(blind_home / "models").import_dir("tiny-dense", tiny_dense_dir)
    with PlatformProcess(blind_home, extra_args=("--rank-blind",),
                         env={"LORAFAAS_ADMIN_KEY": platform.admin_key}) as blind:
        result = cli("--home", str(platform.home), "bench", "fleet", "--url", platform.url, "--functions", "20",
                     "--duration", "10", "--rate", "2", "--drain", "60", "--output-len", "4", "--prompt-len", "8",
                     "--backbone", "tiny-dense", "--adapters-dir", str(tmp_path / "fleet"), "--lorafaas-pid",
                     str(platform.process.pid), "--rank-blind-url", blind.url, "--json",
                     env={"LORAFAAS_API_KEY": platform.admin_key}, timeout=400)
        with blind.client(platform.admin_key) as admin:  # its admin key came from the environment
            assert admin.list() == []  # its fleet is deleted at the end too
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads(result.stdout)
    server, rank_blind = document["servers"]
    assert rank_blind["server"] == "lorafaas-rank-blind" and rank_blind["url"] == blind.url
    assert rank_blind["failed"] == 0 and rank_blind["requests"] == server["requests"]  # the same arrivals
    assert rank_blind["lorafaas"]["healthz_polls"] > 10
    assert server["server"] == "lorafaas" and server["functions"] == 20
    assert server["failed"] == 0 and server["deploy_refused"] == 0, server["failures"]
    assert server["deploy_s"] > 0 and server["requests"] == document["arrivals"] > 0
    assert server["completed"] == server["requests"] and server["short_replies"] == 0
    assert 0 < server["ttft_p50_ms"] <= server["ttft_p99_ms"] <= server["ttft_p999_ms"]
    assert 0 <= server["slo_attainment"] <= 1 and server["output_tokens"] == 4 * server["completed"]
    assert server["output_tokens_per_s"] > 0 and server["peak_pss_mb"] > 100  # gateway, daemon, workers
    figures = server["lorafaas"]
    assert figures["list_cli_s"] > 0 and figures["metrics_bytes"] > 0 and figures["scrape_ms"] > 0
    assert figures["healthz_polls"] > 10 and figures["healthz_failed"] == 0 and figures["healthz_p99_ms"] > 0
    # every function called started an instance once at least, and the starts are counted by kind
    assert sum(figures["cold_starts"].values()) >= document["functions_called"] > 0
    assert document["config"]["api_key"] == "<redacted>"
    assert "deploying 20 functions" in result.stderr  # progress on stderr
    with platform.client() as admin:
        assert admin.list() == []  # the fleet is deleted at the end


@pytest.mark.parametrize(("args", "message"), [
    (["--functions", "0"], "--functions"),
    (["--rate", "-1"], "--rate"),
    (["--duration", "0"], "--duration"),
    (["--vllm", "localhost:8100"], "expected http(s)://"),
    (["--rank-blind-url", "localhost:8101"], "expected http(s)://"),
    (["--batch-size", "501"], "--batch-size"),
    (["--backbone", "no-such-backbone"], "no backbone 'no-such-backbone'"),
    (["--prefix", "9 bad"], "--prefix"),
])
def test_bench_fleet_refuses_bad_options_with_exit_2(platform, cli, args, message) -> None:
    result = cli("--home", str(platform.home), "bench", "fleet", "--url", platform.url, *args,
                 env={"LORAFAAS_API_KEY": platform.admin_key}, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in " ".join(result.stderr.split()), result.stderr
