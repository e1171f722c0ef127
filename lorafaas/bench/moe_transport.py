"""`lorafaas bench moe-transport`: one MoE layer's LoRA round trip (gate/up, then down) over each transport.

One LoRA server process serves the same adapter over shared memory (Unix socket + shm buffer), TCP (loopback) and
the naive HTTP+JSON baseline; the same client process times a layer's two calls on each, for a few decode batch
sizes, in the same run. The layer has Mixtral-8x7B's shape (hidden 4096, intermediate 14336, 8 experts, top-2) and a
rank-16 expert adapter, so the bytes moved are a real layer's. The server's compute is in every figure alike.
"""

from __future__ import annotations

import http.client
import json
import statistics
import tempfile
import time
from pathlib import Path

import msgspec
import torch

SIZES_TOKENS = (1, 8, 32)  # tokens in a decode step of one instance; rows = tokens x top_k


class TransportFigures(msgspec.Struct, frozen=True):
    tokens: int
    rows: int
    shm_ms: float
    tcp_ms: float
    http_json_ms: float
    http_over_shm: float


class MoeTransportResult(msgspec.Struct, frozen=True):
    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    rank: int
    repeats: int
    sizes: list[TransportFigures]
    min_http_over_shm: float


def _write_backbone_config(directory: Path, hidden: int, intermediate: int, num_experts: int, top_k: int) -> None:
    from transformers import MixtralConfig

    config = MixtralConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        num_hidden_layers=1,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=1024,
    )
    config.architectures = ["MixtralForCausalLM"]
    config.save_pretrained(directory)


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1e3


def run_moe_transport_bench(
    progress,
    *,
    repeats: int = 20,
    rank: int = 16,
    hidden: int = 4096,
    intermediate: int = 14336,
    num_experts: int = 8,
    top_k: int = 2,
) -> MoeTransportResult:
    from lorafaas.formats.expert_adapters import write_expert_adapter
    from lorafaas.lora_server.server import LoraServerConfig, spawn_lora_server
    from lorafaas.protocols.lora_transport import LoraServerClient

    with tempfile.TemporaryDirectory(prefix="lorafaas-bench-moe-") as tmp:
        tmp_path = Path(tmp)
        progress.stage(f"writing a Mixtral-shaped layer and a rank-{rank} expert adapter")
        _write_backbone_config(tmp_path / "backbone", hidden, intermediate, num_experts, top_k)
        adapter = write_expert_adapter(tmp_path / "adapter", tmp_path / "backbone", rank=rank, attention_modules=())
        progress.stage("starting the LoRA server")
        config = LoraServerConfig(
            model_dir=tmp_path / "backbone",
            socket_path=tmp_path / "lora.sock",
            tcp="127.0.0.1:0",
            capacity=1,
            num_threads=1,  # small low-rank products: one thread, no pool wake-ups
            http_baseline_port=0,
            client_share=1.0,  # one client measuring transports: the whole compute thread is its to use
        )
        process, addresses = spawn_lora_server(config, timeout_s=120)
        try:
            shm = LoraServerClient.connect(addresses["socket"], client="bench-shm")
            tcp = LoraServerClient.connect(addresses["tcp"], client="bench-tcp")
            for client in (shm, tcp):
                client.register("bench", str(adapter))
            http_host = addresses["http"].removeprefix("http://")
            connection = http.client.HTTPConnection(http_host, timeout=300)
            _http_post(connection, "/v1/adapters", {"adapter_id": "bench", "adapter_dir": str(adapter)})
            figures = []
            progress.stage("timing per-layer round trips", total=len(SIZES_TOKENS))
            for tokens in SIZES_TOKENS:
                rows = tokens * top_k
                counts = [rows // num_experts + (1 if e < rows % num_experts else 0) for e in range(num_experts)]
                generator = torch.Generator().manual_seed(tokens)
                x = torch.randn(rows, hidden, generator=generator)
                h = torch.randn(rows, intermediate, generator=generator)

                def layer(client, x=x, h=h, counts=counts):
                    client.start_call("bench", 0, "gate_up_proj", x, counts).wait()
                    client.start_call("bench", 0, "down_proj", h, counts).wait()

                def layer_http(x=x, h=h, counts=counts):
                    for projection, rows_ in (("gate_up_proj", x), ("down_proj", h)):
                        _http_post(
                            connection,
                            "/v1/lora",
                            {
                                "adapter_id": "bench",
                                "layer": 0,
                                "projection": projection,
                                "expert_counts": counts,
                                "rows": rows_.tolist(),
                            },
                        )

                shm_ms = _median_ms(lambda: layer(shm), repeats)
                tcp_ms = _median_ms(lambda: layer(tcp), repeats)
                http_ms = _median_ms(layer_http, max(3, repeats // 4))
                figures.append(
                    TransportFigures(
                        tokens=tokens,
                        rows=rows,
                        shm_ms=round(shm_ms, 3),
                        tcp_ms=round(tcp_ms, 3),
                        http_json_ms=round(http_ms, 3),
                        http_over_shm=round(http_ms / shm_ms, 1),
                    )
                )
                progress.advance()
            shm.close()
            tcp.close()
            connection.close()
        finally:
            process.terminate()
            process.wait(30)
    return MoeTransportResult(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_experts=num_experts,
        top_k=top_k,
        rank=rank,
        repeats=repeats,
        sizes=figures,
        min_http_over_shm=min(f.http_over_shm for f in figures),
    )


def _http_post(connection: http.client.HTTPConnection, path: str, document: dict) -> dict:
    body = json.dumps(document)
    connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    payload = json.loads(response.read())
    if response.status != 200:
        raise RuntimeError(f"HTTP baseline answered {response.status}: {payload}")
    return payload
