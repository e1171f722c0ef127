"""`lorafaas bench serve`: its statistics, and its client against a real HTTP server streaming SSE on loopback."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from typer.testing import CliRunner

from lorafaas.bench.serve import ServeBenchConfig, Target, make_prompts, one_request, parse_target, run_serve_bench
from lorafaas.bench.serve_stats import (
    PSS_PROBE_CORE_SHARE,
    Distribution,
    LoadProbe,
    MachineLoad,
    RequestOutcome,
    pss_sample_interval_s,
    summarize,
    tree_pss_bytes,
)
from lorafaas.cli import app
from lorafaas.testing.loopback_http import serve_routes
from lorafaas.testing.platform_process import free_port

LOAD = MachineLoad(cores=2, loadavg_1m_start=0.5, loadavg_1m_end=0.7, busy_cores=1.0, client_cores=0.1)


def test_distribution_uses_linear_percentiles_in_ms() -> None:
    d = Distribution.of([0.001 * v for v in range(1, 101)])  # 1..100 ms
    assert d.mean_ms == pytest.approx(50.5)
    assert d.p50_ms == pytest.approx(50.5)
    assert d.p90_ms == pytest.approx(90.1)
    assert d.p99_ms == pytest.approx(99.01)
    assert Distribution.of([]) == Distribution(mean_ms=0.0, p50_ms=0.0, p90_ms=0.0, p99_ms=0.0)


def test_summarize_counts_only_completed_requests_and_defines_tpot_as_vllm() -> None:
    outcomes = [
        RequestOutcome(model="a", ok=True, ttft_s=0.1, latency_s=1.1, output_tokens=11, prompt_tokens=30,
                       chunk_gaps_s=(0.1,) * 10),
        RequestOutcome(model="b", ok=True, ttft_s=0.3, latency_s=2.3, output_tokens=21, prompt_tokens=34,
                       chunk_gaps_s=(0.1,) * 20),
        RequestOutcome(model="c", ok=True, ttft_s=0.2, latency_s=0.2, output_tokens=1),  # no TPOT: one token
        RequestOutcome(model="a", ok=False, error="HTTP 503: busy"),
        RequestOutcome(model="b", ok=False, error="HTTP 503: busy"),
    ]
    level = summarize("x", "http://x", 4, outcomes, duration_s=2.0, load=LOAD, output_len=21)
    assert (level.requests, level.completed, level.failed) == (5, 3, 2)
    assert level.output_tokens == 33
    assert level.short_replies == 2  # 11 and 1 of 21 tokens
    assert level.output_tokens_per_s == pytest.approx(16.5)
    assert level.requests_per_s == pytest.approx(1.5)
    assert level.mean_prompt_tokens == pytest.approx(32.0)
    assert level.ttft.p50_ms == pytest.approx(200.0)
    assert level.tpot.mean_ms == pytest.approx(100.0)  # (1.1-0.1)/10 and (2.3-0.3)/20
    assert level.itl.p99_ms == pytest.approx(100.0)
    assert level.errors == ("HTTP 503: busy",)


def test_prompts_are_seeded_and_of_the_asked_length() -> None:
    assert make_prompts(4, 32, seed=1) == make_prompts(4, 32, seed=1)
    assert make_prompts(4, 32, seed=1) != make_prompts(4, 32, seed=2)
    assert all(len(p.split()) == 32 for p in make_prompts(8, 32, seed=0))


def test_parse_target() -> None:
    assert parse_target("vllm=http://127.0.0.1:8100/v1/", 0) == Target(label="vllm", url="http://127.0.0.1:8100")
    assert parse_target("http://127.0.0.1:8000", 0).label == "127.0.0.1:8000"
    with pytest.raises(ValueError, match="--url"):
        parse_target("localhost:8000", 0)


# A real OpenAI-style server: streams `max_tokens` one-word chunks, 5 ms apart, then a usage chunk if asked.
# Model "broken" answers 500; model "erroring" streams one chunk and then an error event, as lorafaas does; model
# "early" stops after 2 tokens whatever ignore_eos says (as a server that ignores the field).
SEEN: list[dict] = []


async def completions(request: Request):
    body = await request.json()
    SEEN.append({**body, "authorization": request.headers.get("authorization")})
    if body["model"] == "broken":
        return JSONResponse({"error": {"message": "down"}}, status_code=500)

    async def events():
        for i in range(2 if body["model"] == "early" else body["max_tokens"]):
            await asyncio.sleep(0.005)
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f' w{i}', 'finish_reason': None}]})}\n\n"
            if body["model"] == "erroring":
                yield f"data: {json.dumps({'error': {'message': 'instance died'}})}\n\n"
                return
        if body.get("stream_options", {}).get("include_usage"):
            tokens = 2 if body["model"] == "early" else body["max_tokens"]
            usage = {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": tokens}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def sse_server() -> Iterator[str]:
    with serve_routes([Route("/v1/completions", completions, methods=["POST"])]) as url:
        yield url


def _one(url: str, model: str, **config) -> RequestOutcome:
    async def go() -> RequestOutcome:
        async with httpx.AsyncClient() as http:
            return await one_request(http, Target(label="t", url=url), model, "one two three",
                                     ServeBenchConfig(models=(model,), concurrencies=(1,), requests=1, **config))
    return asyncio.run(go())


def test_client_times_a_stream_and_reads_the_servers_token_count(sse_server: str) -> None:
    SEEN.clear()
    outcome = _one(sse_server, "a", output_len=8, ignore_eos=True, api_key="k1")
    assert outcome.ok, outcome.error
    assert outcome.output_tokens == 8 and outcome.prompt_tokens == 3
    assert len(outcome.chunk_gaps_s) == 7
    assert 0 < outcome.ttft_s < outcome.latency_s
    sent = SEEN[0]
    assert sent["stream"] is True and sent["max_tokens"] == 8 and sent["ignore_eos"] is True
    assert sent["stream_options"] == {"include_usage": True}
    assert sent["authorization"] == "Bearer k1"


def test_client_reports_http_errors_and_error_events_as_failures(sse_server: str) -> None:
    broken = _one(sse_server, "broken")
    assert not broken.ok and broken.error.startswith("HTTP 500") and "down" in broken.error
    erroring = _one(sse_server, "erroring")
    assert not erroring.ok and "instance died" in erroring.error
    refused = _one(f"http://127.0.0.1:{free_port()}", "a")
    assert not refused.ok and "ConnectError" in refused.error


def test_run_spreads_requests_round_robin_and_alternates_targets(sse_server: str) -> None:
    SEEN.clear()
    targets = [Target(label="A", url=sse_server), Target(label="B", url=sse_server)]
    config = ServeBenchConfig(models=("a", "b", "c"), concurrencies=(2, 4), requests=6, output_len=4, warmup=False)
    result = run_serve_bench(targets, config)
    assert [(lv.target, lv.concurrency) for lv in result.levels] == [("A", 2), ("B", 2), ("B", 4), ("A", 4)]
    assert all(lv.completed == 6 and lv.failed == 0 and lv.output_tokens == 24 for lv in result.levels)
    assert sorted(body["model"] for body in SEEN[:6]) == ["a", "a", "b", "b", "c", "c"]
    assert all(lv.output_tokens_per_s > 0 and lv.ttft.p50_ms > 0 for lv in result.levels)


def test_cli_prints_json_and_fails_on_failed_requests(sse_server: str) -> None:
    runner = CliRunner()
    ok = runner.invoke(app, ["bench", "serve", "--url", f"fake={sse_server}", "--model", "a,b", "--concurrency", "2",
                             "--requests", "4", "--output-len", "3", "--json", "--no-warmup",
                             "--api-key", "secret-key-1"])
    assert ok.exit_code == 0, ok.output
    assert "secret-key-1" not in ok.output and SEEN[-1]["authorization"] == "Bearer secret-key-1"
    document = json.loads(ok.output[ok.output.index("{"):])
    assert document["levels"][0]["completed"] == 4 and document["levels"][0]["target"] == "fake"
    failed = runner.invoke(app, ["bench", "serve", "--url", sse_server, "--model", "broken", "--concurrency", "1",
                                 "--requests", "1", "--no-warmup"])
    assert failed.exit_code == 1
    bad = runner.invoke(app, ["bench", "serve", "--url", sse_server, "--model", "a", "--concurrency", "8,x"])
    assert bad.exit_code == 2 and "--concurrency" in bad.output


def test_cli_says_when_a_server_ignores_ignore_eos(sse_server: str) -> None:
    result = CliRunner().invoke(app, ["bench", "serve", "--url", f"fake={sse_server}", "--model", "early,a",
                                      "--concurrency", "2", "--requests", "4", "--output-len", "5", "--ignore-eos",
                                      "--no-warmup"])
    assert result.exit_code == 0, result.output
    assert "2 replies stopped before 5 tokens" in " ".join(result.output.split())


def test_load_probe_reports_the_peak_pss_of_the_servers_process_tree(tmp_path) -> None:
    """The server's child takes 300 MB for 1.5 s during the level and gives it back before its end: the peak shows
    it, the tree's PSS at the end does not. (The child marks when it took and gave back the memory, so a slow machine
    starting the processes late changes nothing.)"""
    taken, freed = tmp_path / "taken", tmp_path / "freed"
    child = (f"import pathlib, time; b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096]); "
             f"pathlib.Path({str(taken)!r}).touch(); time.sleep(1.5); del b; pathlib.Path({str(freed)!r}).touch(); "
             f"time.sleep(60)")
    server = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', "
                                                     f"{child!r}])"])
    try:
        probe = LoadProbe(server.pid)
        probe.start()
        deadline = time.monotonic() + 60
        while not freed.exists():
            assert time.monotonic() < deadline, "the test's child never gave its memory back"
            time.sleep(0.05)
        load = probe.stop()
        assert taken.exists()
        assert load.server_pss_peak_mb is not None and load.server_pss_peak_mb >= 300
        assert load.server_pss_samples is not None and load.server_pss_samples >= 3
        assert tree_pss_bytes(server.pid) < 200 * 2**20  # given back: only the peak remembers it
    finally:
        for process in [*psutil.Process(server.pid).children(recursive=True), server]:
            process.kill()
        server.wait()
    assert LoadProbe(None).server_pid is None and tree_pss_bytes(2**22 + 12345) == 0


def test_pss_samples_are_spaced_so_the_probe_takes_a_bounded_share_of_a_core() -> None:
    """Summing a large tree's PSS costs the kernel a page-table walk per process (60-70 ms of CPU for eight SmolLM2
    workers): sampled every 0.5 s that took 6-19% of the throughput being measured. A costly sample waits long
    enough that the probe's share of one core stays at PSS_PROBE_CORE_SHARE; a cheap one still samples often."""
    for cost_s in (0.066, 0.2, 1.0):
        interval = pss_sample_interval_s(cost_s)
        assert cost_s / interval <= PSS_PROBE_CORE_SHARE + 1e-12
    assert pss_sample_interval_s(0.001) == pss_sample_interval_s(0.0) <= 0.5
