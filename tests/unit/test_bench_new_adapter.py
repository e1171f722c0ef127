"""`lorafaas bench new-adapter` against a real HTTP server speaking vLLM's runtime LoRA API on loopback (the lorafaas
side runs against a real platform in tests/integration/test_bench_serve_platform.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from lorafaas.bench.new_adapter import NewAdapterConfig, NewAdapterTarget, run_new_adapter_bench
from lorafaas.testing.fake_completions import completion_stream
from lorafaas.testing.loopback_http import serve_routes

calls: list[tuple[str, str]] = []  # (what, adapter name)
loaded: set[str] = set()


async def load(request: Request):
    body = await request.json()
    if Path(body["lora_path"]).name == "refuse":
        return PlainTextResponse("runtime LoRA updating is disabled", status_code=400)
    await asyncio.sleep(0.02)
    loaded.add(body["lora_name"])
    calls.append(("load", body["lora_name"]))
    return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' added successfully.")


async def unload(request: Request):
    name = (await request.json())["lora_name"]
    loaded.discard(name)
    calls.append(("unload", name))
    return PlainTextResponse("Success")


async def completions(request: Request):
    body = await request.json()
    calls.append(("complete", body["model"]))
    if body["model"] not in loaded:
        return JSONResponse({"error": {"message": f"model {body['model']} does not exist"}}, status_code=404)
    return completion_stream(body["max_tokens"])


@pytest.fixture(scope="module")
def vllm_like() -> Iterator[str]:
    with serve_routes([Route("/v1/load_lora_adapter", load, methods=["POST"]),
                       Route("/v1/unload_lora_adapter", unload, methods=["POST"]),
                       Route("/v1/completions", completions, methods=["POST"])]) as url:
        yield url


def _adapter(tmp_path: Path) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\0" * 16)
    return tmp_path


def test_each_sample_loads_a_new_name_serves_it_and_unloads_it(vllm_like: str, tmp_path: Path) -> None:
    calls.clear()
    config = NewAdapterConfig(adapter_dir=str(_adapter(tmp_path)), repeats=3, output_len=4, settle_s=0.0)
    result = run_new_adapter_bench([NewAdapterTarget(kind="vllm", url=vllm_like)], config)
    names = [s.name for s in result.samples]
    assert len(set(names)) == 3
    expected = [(what, name) for name in names for what in ("load", "complete", "unload")]
    assert calls == expected
    for sample in result.samples:
        assert sample.register_s >= 0.02 and sample.ttft_s > 0 and sample.total_s == sample.register_s + sample.ttft_s
    [summary] = result.summaries
    assert summary.median_total_s == sorted(s.total_s for s in result.samples)[1]
    assert not loaded  # nothing left behind


def test_a_refused_registration_is_an_error_naming_the_server(vllm_like: str, tmp_path: Path) -> None:
    refused = _adapter(tmp_path / "refuse")  # the test server refuses it, as vLLM without runtime LoRA updating
    with pytest.raises(RuntimeError, match=r"vllm at http://127\.0\.0\.1:\d+: registering adapter new-\w+ answered "
                                           r"HTTP 400: runtime LoRA updating is disabled"):
        run_new_adapter_bench([NewAdapterTarget(kind="vllm", url=vllm_like)],
                              NewAdapterConfig(adapter_dir=str(refused), repeats=1, settle_s=0.0))
    with pytest.raises(ValueError, match=r"adapter_config\.json"):
        run_new_adapter_bench([NewAdapterTarget(kind="vllm", url=vllm_like)],
                              NewAdapterConfig(adapter_dir=str(tmp_path / "nowhere"), repeats=1))


def test_the_result_never_carries_the_api_key(vllm_like: str, tmp_path: Path) -> None:
    """Results get pasted into notes and issues: the key is replaced, as `bench serve` does, and only whether one was
    sent remains (the requests themselves still carried it)."""
    config = NewAdapterConfig(adapter_dir=str(_adapter(tmp_path)), repeats=1, output_len=2, settle_s=0.0,
                              api_key="lf-secret-key-123")
    result = run_new_adapter_bench([NewAdapterTarget(kind="vllm", url=vllm_like)], config)
    assert result.config.api_key == "<redacted>"
    assert "lf-secret-key-123" not in msgspec.json.encode(result).decode()
    unkeyed = run_new_adapter_bench([NewAdapterTarget(kind="vllm", url=vllm_like)],
                                    NewAdapterConfig(adapter_dir=str(_adapter(tmp_path)), repeats=1, output_len=2,
                                                     settle_s=0.0))
    assert unkeyed.config.api_key is None
