"""The LoRA server as a real process: remote mode equals local mode, shm and TCP transports, errors, the cache."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lorafaas.cuda_ipc.shm import list_segments
from lorafaas.errors import AdapterIncompatible, AdapterInvalid, DaemonUnavailable, InvalidInput
from lorafaas.formats.expert_adapters import load_expert_layer, read_expert_adapter_info, write_expert_adapter
from lorafaas.lora_server.server import LoraServerConfig, spawn_lora_server
from lorafaas.models.moe_lora import grouped_lora_delta
from lorafaas.protocols.lora_transport import BUFFER_PREFIX, LoraServerClient

NUM_ADAPTERS = 3
REPEATS = 5


@pytest.fixture(scope="module")
def expert_adapters(tmp_path_factory: pytest.TempPathFactory, tiny_moe_dir: Path) -> list[Path]:
    root = tmp_path_factory.mktemp("expert-adapters")
    return [
        write_expert_adapter(root / f"a{i}", tiny_moe_dir, seed=10 + i, base_model_name="tiny-moe")
        for i in range(NUM_ADAPTERS)
    ]


@pytest.fixture(scope="module")
def lora_server(
    tmp_path_factory: pytest.TempPathFactory, tiny_moe_dir: Path
) -> Iterator[tuple[subprocess.Popen, dict[str, str]]]:
    """One server process for the module (capacity 2, so three adapters make it evict)."""
    socket_path = tmp_path_factory.mktemp("lora-server") / "lora.sock"
    config = LoraServerConfig(
        model_dir=tiny_moe_dir, socket_path=socket_path, tcp="127.0.0.1:0", capacity=2, num_threads=1
    )
    process, addresses = spawn_lora_server(config)
    try:
        yield process, addresses
    finally:
        process.terminate()
        process.wait(10)


def _probe(
    tiny_moe_dir: Path,
    adapter: Path,
    mode: str,
    out: Path,
    server: str | None = None,
    go: Path | None = None,
    repeats: int = 1,
) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "lorafaas.testing.moe_probe",
        "--model-dir",
        str(tiny_moe_dir),
        "--adapter",
        str(adapter),
        "--mode",
        mode,
        "--out",
        str(out),
        "--repeats",
        str(repeats),
    ]
    command += ["--server", server] if server else []
    command += ["--go", str(go)] if go else []
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _finish(process: subprocess.Popen) -> None:
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-3000:]


def test_remote_mode_equals_local_mode_for_several_adapters_served_concurrently_by_one_server(
    tmp_path: Path, tiny_moe_dir: Path, expert_adapters: list[Path], lora_server
) -> None:
    _, addresses = lora_server
    with LoraServerClient.connect(addresses["socket"]) as client:
        before = client.status()
    go = tmp_path / "go"
    remote = [
        _probe(tiny_moe_dir, a, "remote", tmp_path / f"remote{i}.json", addresses["socket"], go, REPEATS)
        for i, a in enumerate(expert_adapters)
    ]
    go.touch()  # the remote probes start together: their calls meet in the server's batches
    for process in remote:
        _finish(process)

    plain = _plain_logits(tiny_moe_dir)
    for i, adapter in enumerate(expert_adapters):
        remote_logits = load_file(tmp_path / f"remote{i}.safetensors")["logits"]
        local_logits, local_held = _local_logits(tiny_moe_dir, adapter)
        assert (remote_logits - local_logits).abs().max().item() <= 1e-5
        assert (remote_logits - plain).abs().max().item() > 1e-2  # the adapter really changes the output
        remote_report = json.loads((tmp_path / f"remote{i}.json").read_text())
        info = read_expert_adapter_info(adapter)
        assert local_held == info.expert_bytes + info.attention_bytes
        assert remote_report["held_adapter_bytes"] == info.attention_bytes  # no expert factor in the instance
    first = [load_file(tmp_path / f"remote{i}.safetensors")["logits"] for i in range(NUM_ADAPTERS)]
    assert (first[0] - first[1]).abs().max().item() > 1e-2  # each instance got its own adapter's deltas

    with LoraServerClient.connect(addresses["socket"]) as client:
        status = client.status()
    assert status.num_adapters == 0  # the probes are gone, and their adapters with them
    assert status.num_deferred == 0 and status.num_refused == 0  # honest functions stay within their budgets
    # probes x forwards x MoE layers x (gate/up, down)
    assert status.num_calls - before.num_calls == NUM_ADAPTERS * REPEATS * 2 * 2
    # capacity 2 for 3 adapters: evicted, or forgotten with the last connection that registered them (eviction
    # itself: tests/unit/test_moe_lora_server.py)
    assert not status.cache.resident and status.cache.num_misses >= NUM_ADAPTERS
    assert not list_segments(BUFFER_PREFIX)  # buffers are unlinked as soon as both sides map them


def _local_logits(model_dir: Path, adapter_dir: Path) -> tuple[torch.Tensor, int]:
    """Local mode, as the probe runs it (same code path), in this process."""
    from transformers import AutoModelForCausalLM

    from lorafaas.models.lora import attach_adapter
    from lorafaas.models.moe_lora import install_expert_lora, open_moe_adapter
    from lorafaas.testing.moe_probe import PROBE_IDS

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    adapter = open_moe_adapter(adapter_dir, "local")
    install_expert_lora(model, adapter.source, adapter.info)
    attach_adapter(model, adapter.attention)
    with torch.inference_mode():
        return model(torch.tensor(PROBE_IDS)).logits, adapter.held_bytes


def _plain_logits(model_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from lorafaas.testing.moe_probe import PROBE_IDS

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        return model(torch.tensor(PROBE_IDS)).logits


def test_tcp_transport_carries_the_same_messages_and_gives_the_same_deltas(
    tiny_moe_dir: Path, expert_adapters: list[Path], lora_server
) -> None:
    _, addresses = lora_server
    adapter = expert_adapters[0]
    info = read_expert_adapter_info(adapter)
    factors = load_expert_layer(info, 1)
    generator = torch.Generator().manual_seed(0)
    rows = {
        "gate_up_proj": torch.randn(10, 64, generator=generator),
        "down_proj": torch.randn(10, 128, generator=generator),
    }
    counts = [3, 0, 5, 2]
    results = {}
    for transport in ("socket", "tcp"):
        with LoraServerClient.connect(addresses[transport], client=f"test-{transport}") as client:
            assert client.transport == ("shm" if transport == "socket" else "tcp")
            client.register("a0", str(adapter))
            for projection, x in rows.items():
                results[transport, projection] = client.start_call("a0", 1, projection, x, counts).wait().clone()
    for projection, x in rows.items():
        expected = grouped_lora_delta(x, counts, factors[projection])
        assert torch.equal(results["socket", projection], results["tcp", projection])
        torch.testing.assert_close(results["tcp", projection], expected, atol=1e-6, rtol=1e-5)


def test_bad_calls_get_clear_errors_and_the_connection_keeps_working(
    tmp_path: Path, tiny_dense_dir: Path, expert_adapters: list[Path], lora_server
) -> None:
    _, addresses = lora_server
    with LoraServerClient.connect(addresses["socket"]) as client:
        with pytest.raises(AdapterInvalid, match="not registered"):
            client.start_call("nobody", 0, "gate_up_proj", torch.zeros(1, 64), [1, 0, 0, 0]).wait()
        client.register("a0", str(expert_adapters[0]))
        with pytest.raises(InvalidInput, match="expert_counts"):
            client.start_call("a0", 0, "gate_up_proj", torch.zeros(2, 64), [1, 1]).wait()
        with pytest.raises(AdapterIncompatible, match="layer 7"):
            client.start_call("a0", 7, "gate_up_proj", torch.zeros(1, 64), [1, 0, 0, 0]).wait()
        with pytest.raises(InvalidInput, match="registered on this connection with another"):
            client.register("a0", str(expert_adapters[1]))
        with pytest.raises(AdapterInvalid):
            client.register("plain", str(tmp_path))  # not an adapter at all
        # a call bigger than the buffer grows it; the connection still answers
        big = torch.randn(4000, 64)
        delta = client.start_call("a0", 0, "gate_up_proj", big, [1000, 1000, 1000, 1000]).wait()
        assert delta.shape == (4000, 256)
        assert "a0" in client.status().cache.resident  # the big call went through the cache


def test_a_missing_server_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DaemonUnavailable, match="no LoRA server"):
        LoraServerClient.connect(str(tmp_path / "nobody.sock"))
