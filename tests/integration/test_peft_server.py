"""The plain transformers + PEFT baseline (`lorafaas.bench.peft_server`): its mixed-adapter batches against each
adapter decoded alone, then the server as a real process on the tiny backbone, and `bench serve` against it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from lorafaas.bench.peft_server import Row, generate_batch, load_model
from lorafaas.bench.serve import ServeBenchConfig, Target, run_serve_bench
from lorafaas.sse import aevents
from lorafaas.testing.child_process import stop_child
from lorafaas.testing.platform_process import free_port
from lorafaas.testing.tiny_models import save_tiny_adapter

# token id prompts of different lengths, so a batch of them is left-padded
PROMPTS = ([291, 463, 311, 77, 495, 415, 287, 396], [120, 33, 250], [77, 88, 99, 300, 301], [400, 12])
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_dense_dir: Path) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("peft-server-adapters")
    return {"alpha": save_tiny_adapter(out / "alpha", tiny_dense_dir, seed=1),
            "beta": save_tiny_adapter(out / "beta", tiny_dense_dir, seed=2,
                                      target_modules=("q_proj", "v_proj", "o_proj"))}


@pytest.fixture(scope="module")
def reference(tiny_dense_dir: Path, adapters: dict[str, Path]):
    """(the PEFT model with both adapters, the tokenizer, {(adapter, prompt index): the tokens it decodes alone})."""
    model, tokenizer = load_model(tiny_dense_dir, adapters, "cpu", "float32")
    alone = {(name, i): greedy_alone(model, name, prompt, MAX_TOKENS)
             for name in adapters for i, prompt in enumerate(PROMPTS)}
    # the adapters differ where it is checked, so a row answered with the other's adapter would be caught
    assert any(alone["alpha", i] != alone["beta", i] for i in range(len(PROMPTS)))
    return model, tokenizer, alone


def greedy_alone(model, adapter: str, prompt: list[int], count: int) -> list[int]:
    """Greedy decoding by hand: one adapter active, one unpadded row, the whole sequence at each step (no cache)."""
    model.set_adapter(adapter)
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(count):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_a_mixed_batch_gives_each_row_what_its_adapter_gives_alone(reference) -> None:
    model, tokenizer, alone = reference
    names = ["alpha", "beta", "alpha", "beta"]
    lengths = [MAX_TOKENS, 5, MAX_TOKENS, 3]  # shorter rows are cut to their own max_tokens
    rows = [Row(name, list(prompt), n, ignore_eos=True)
            for name, prompt, n in zip(names, PROMPTS, lengths, strict=True)]
    results = generate_batch(model, rows, tokenizer.pad_token_id, frozenset([tokenizer.eos_token_id]))
    for i, (row, result) in enumerate(zip(rows, results, strict=True)):
        assert result.token_ids == alone[row.adapter, i][:row.max_tokens], row
        assert result.finish_reason == "length"


def test_without_ignore_eos_a_row_ends_at_its_first_eos(reference) -> None:
    model, tokenizer, alone = reference
    expected = alone["beta", 0]
    eos = expected[-1]  # pretend the token it decodes last is the EOS: it appears before the 8th
    assert expected.index(eos) < MAX_TOKENS - 1
    rows = [Row("beta", list(PROMPTS[0]), MAX_TOKENS, ignore_eos=False),
            Row("alpha", list(PROMPTS[1]), MAX_TOKENS, ignore_eos=True)]
    stopped, kept = generate_batch(model, rows, tokenizer.pad_token_id, frozenset([eos]))
    assert stopped.token_ids == expected[:expected.index(eos) + 1] and stopped.finish_reason == "stop"
    assert kept.token_ids == alone["alpha", 1] and kept.finish_reason == "length"  # ignore_eos: all 8


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_dense_dir: Path, adapters: dict[str, Path]):
    port = free_port()
    log = tmp_path_factory.mktemp("peft-server-log") / "server.log"
    command = [sys.executable, "-m", "lorafaas.bench.peft_server", "--model", str(tiny_dense_dir), "--port", str(port),
               "--max-batch", "4", *(arg for name, path in adapters.items() for arg in ("--adapter", f"{name}={path}"))]
    with log.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, f"the server exited {process.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"the server did not answer /health in 60 s:\n{log.read_text()}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield url, process
    finally:
        stop_child(process)


async def complete(http: httpx.AsyncClient, url: str, model: str, prompt: list[int], stream: bool) -> dict:
    """One request; the answer as {"text", "usage"}, read from the stream's chunks when streaming."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    if not stream:
        reply = await http.post(f"{url}/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        return {"text": reply.json()["choices"][0]["text"], "usage": reply.json()["usage"]}
    text, usage, done = "", None, False
    async with http.stream("POST", f"{url}/v1/completions", json=body) as reply:
        assert reply.status_code == 200
        async for event in aevents(reply):
            if event.done:
                done = True
                break
            text += "".join(choice["text"] for choice in event.data["choices"])
            usage = event.data.get("usage") or usage
    assert done, "the stream did not end with [DONE]"
    return {"text": text, "usage": usage}


def test_concurrent_requests_for_both_adapters_get_what_each_gives_alone(server, reference) -> None:
    url, _ = server
    _, tokenizer, alone = reference
    requests = [("alpha", 0, False), ("alpha", 1, True), ("beta", 2, False), ("beta", 3, True),
                ("beta", 0, True), ("beta", 1, False), ("alpha", 2, True), ("alpha", 3, False)]
    before = httpx.get(f"{url}/health").json()

    async def send_all() -> list[dict]:
        async with httpx.AsyncClient(timeout=60) as http:
            # a long request holds the worker while the others queue up, so they run as mixed batches
            blocker = asyncio.create_task(http.post(f"{url}/v1/completions", json={
                "model": "beta", "prompt": [400], "max_tokens": 250, "ignore_eos": True}))
            await asyncio.sleep(0.1)
            answers = await asyncio.gather(*(complete(http, url, name, list(PROMPTS[i]), stream)
                                             for name, i, stream in requests))
            assert (await blocker).json()["usage"]["completion_tokens"] == 250
            return answers

    answers = asyncio.run(send_all())
    for (name, i, stream), answer in zip(requests, answers, strict=True):
        assert answer["text"] == tokenizer.decode(alone[name, i], skip_special_tokens=True), (name, i, stream)
        assert answer["usage"] == {"prompt_tokens": len(PROMPTS[i]), "completion_tokens": MAX_TOKENS,
                                   "total_tokens": len(PROMPTS[i]) + MAX_TOKENS}
    after = httpx.get(f"{url}/health").json()
    rows, batches = after["rows"] - before["rows"], after["batches"] - before["batches"]
    assert rows == len(requests) + 1 and len(requests) / 4 + 1 <= batches < rows  # some ran together, <= 4 a batch


def test_it_lists_its_adapters_and_refuses_what_it_does_not_serve(server) -> None:
    url, _ = server
    assert [card["id"] for card in httpx.get(f"{url}/v1/models").json()["data"]] == ["alpha", "beta"]
    body = {"model": "alpha", "prompt": "The quick brown fox", "max_tokens": 4}
    unknown = httpx.post(f"{url}/v1/completions", json={**body, "model": "gamma"})
    assert unknown.status_code == 404 and "gamma" in unknown.json()["error"]["message"]
    for field, value in [("top_p", 0.9), ("n", 2), ("temperature", 0.7)]:
        refused = httpx.post(f"{url}/v1/completions", json={**body, field: value})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == field and field in refused.json()["error"]["message"]
    text_prompt = httpx.post(f"{url}/v1/completions", json=body)  # a text prompt is tokenized by the server
    assert text_prompt.status_code == 200 and text_prompt.json()["usage"]["completion_tokens"] <= 4


def test_bench_serve_completes_a_level_against_it(server) -> None:
    url, process = server
    config = ServeBenchConfig(models=("alpha", "beta"), concurrencies=(4,), requests=8, output_len=MAX_TOKENS,
                              prompt_len=8, ignore_eos=True)
    [level] = run_serve_bench([Target(label="peft", url=url, server_pid=process.pid)], config).levels
    assert level.completed == 8 and level.failed == 0, level.errors
    assert level.output_tokens == 8 * MAX_TOKENS and level.short_replies == 0
