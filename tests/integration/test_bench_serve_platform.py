"""`lorafaas bench serve` against a real `lorafaas up` (tiny backbone): its OpenAI route streamed, as vLLM's is."""

from __future__ import annotations

import json

import httpx
import pytest

from lorafaas.formats.model_store import ModelStore
from lorafaas.testing.platform_process import PlatformProcess
from lorafaas.testing.tiny_models import save_tiny_adapter


@pytest.fixture(scope="module")
def platform(tmp_path_factory, tiny_dense_dir):
    home = tmp_path_factory.mktemp("bench-serve-home")
    ModelStore(home / "models").import_dir("tiny-dense", tiny_dense_dir)
    adapters = tmp_path_factory.mktemp("bench-serve-adapters")
    with PlatformProcess(home) as running, running.client() as admin:
        for seed, name in enumerate(["alpha", "beta"], start=1):
            adapter = save_tiny_adapter(adapters / name, tiny_dense_dir, seed=seed, base_model_name="tiny-dense")
            admin.deploy({"name": name, "backbone": "tiny-dense"}, adapter)
        yield running


def test_bench_serve_measures_a_running_platform(platform, cli) -> None:
    result = cli("bench", "serve", "--url", f"lorafaas={platform.url}", "--model", "alpha,beta",
                 "--concurrency", "1,3", "--requests", "6", "--output-len", "8", "--prompt-len", "12",
                 "--api-key", platform.admin_key, "--server-pid", f"lorafaas={platform.process.pid}", "--json",
                 timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads(result.stdout)
    assert [(lv["target"], lv["concurrency"]) for lv in document["levels"]] == [("lorafaas", 1), ("lorafaas", 3)]
    for level in document["levels"]:
        assert level["completed"] == 6 and level["failed"] == 0, level["errors"]
        assert 6 <= level["output_tokens"] <= 48  # the server's own count (usage), at most max_tokens each
        assert level["output_tokens_per_s"] > 0 and level["ttft"]["p50_ms"] > 0
        assert level["mean_prompt_tokens"] > 0
        # the platform and its function processes did the work, and their CPU time was read
        assert level["load"]["server_pid"] == platform.process.pid and level["load"]["server_cores"] > 0
        # and their memory: the gateway, the backbone daemon and the two functions' workers, at least
        assert level["load"]["server_pss_peak_mb"] > 100


def test_bench_serve_reports_a_refused_key_as_failed_requests(platform, cli) -> None:
    result = cli("bench", "serve", "--url", platform.url, "--model", "alpha", "--concurrency", "1",
                 "--requests", "2", "--output-len", "4", "--api-key", "not-a-key", "--no-warmup", "--json")
    assert result.returncode == 1
    [level] = json.loads(result.stdout)["levels"]
    assert level["failed"] == 2 and level["errors"][0].startswith("HTTP 401")


def test_bench_new_adapter_deploys_a_new_function_per_sample_and_removes_it(platform, cli, tmp_path,
                                                                            tiny_dense_dir) -> None:
    adapter = save_tiny_adapter(tmp_path / "fresh", tiny_dense_dir, seed=7, base_model_name="tiny-dense")
    result = cli("bench", "new-adapter", "--lorafaas", platform.url, "--adapter", str(adapter), "--backbone",
                 "tiny-dense", "--repeats", "2", "--output-len", "4", "--settle", "0", "--api-key", platform.admin_key,
                 "--json", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads(result.stdout)
    samples = document["samples"]
    assert len(samples) == 2 and len({s["name"] for s in samples}) == 2  # a name never used before, each time
    for sample in samples:
        assert sample["kind"] == "lorafaas" and sample["register_s"] > 0 and sample["ttft_s"] > 0
        assert sample["total_s"] == sample["register_s"] + sample["ttft_s"]
        # its instance's start, stage by stage, to the first token of its first request
        assert {"prepare", "spawn", "adapter", "total", "first_prefill", "first_token"} <= set(sample["stages"])
    [summary] = document["summaries"]
    assert summary["median_total_s"] == (samples[0]["total_s"] + samples[1]["total_s"]) / 2
    assert summary["median_stages"]["first_token"] > 0
    metrics = httpx.get(f"{platform.url}/metrics", headers={"Authorization": f"Bearer {platform.admin_key}"}).text
    assert 'lorafaas_instance_start_seconds_count{stage="first_token"}' in metrics  # one series per stage
    with platform.client() as admin:  # each sample's function was deleted after its first token
        assert {f.name for f in admin.list()} == {"alpha", "beta"}


def test_bench_new_adapter_says_what_is_wrong(platform, cli, tmp_path) -> None:
    result = cli("bench", "new-adapter", "--lorafaas", platform.url, "--adapter", str(tmp_path))
    assert result.returncode == 1 and "adapter_config.json" in result.stdout
    result = cli("bench", "new-adapter", "--adapter", str(tmp_path))
    assert result.returncode == 2 and "--lorafaas" in result.stdout + result.stderr
