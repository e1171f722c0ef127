"""A function worker listening on TCP, as it does in a pod: the same protocol and output as over its Unix socket."""

import asyncio
import socket
import time
from pathlib import Path

import msgspec
import pytest

from lorafaas.errors import InstanceUnavailable, InvalidInput
from lorafaas.function_runtime import messages as m
from lorafaas.function_runtime.client import WorkerClient, tcp_address
from lorafaas.function_runtime.zygote import start_fresh_worker
from lorafaas.platform.backends.local import LocalLauncher
from lorafaas.testing.tiny_models import save_tiny_adapter


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def connect_when_listening(address: str, process, timeout_s: float = 120.0) -> WorkerClient:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await WorkerClient.connect(address, client="test")
        except InstanceUnavailable:
            if process.poll() is not None or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def generate_ids(worker: WorkerClient) -> list[int]:
    request = m.Generate(request_id="r1", prompt="The quick brown fox", params=m.SamplingParams(max_tokens=8))
    return [event.token_id async for event in worker.generate(request) if isinstance(event, m.Token)]


def test_tcp_addresses_parse_and_bad_ones_are_refused() -> None:
    assert tcp_address("tcp://0.0.0.0:9000") == ("0.0.0.0", 9000)
    assert tcp_address("tcp://[::1]:80") == ("::1", 80)
    assert tcp_address("/run/worker.sock") is None
    for bad in ("tcp://nohost", "tcp://:80", "tcp://h:0", "tcp://h:70000", "tcp://h:x"):
        with pytest.raises(InvalidInput, match="tcp://HOST:PORT"):
            tcp_address(bad)


def test_a_worker_on_tcp_generates_what_the_unix_socket_worker_does(tmp_path: Path, tiny_dense_dir: Path) -> None:
    with LocalLauncher(tmp_path) as launcher:
        launcher.store.import_dir("tiny-dense", tiny_dense_dir)
        adapter = save_tiny_adapter(tmp_path / "adapters" / "alpha", tmp_path / "models" / "tiny-dense", seed=1)
        unix_spec = launcher.spec("alpha", "tiny-dense", adapter)
        address = f"tcp://127.0.0.1:{free_port()}"
        tcp_spec = msgspec.structs.replace(unix_spec, instance_id="alpha-tcp", socket_path=address)
        unix_worker = launcher.launch(unix_spec, fresh=True)
        process = start_fresh_worker(tcp_spec, tmp_path / "tcp-worker.log")
        try:

            async def scenario() -> tuple[list[int], list[int]]:
                async with await connect_when_listening(address, process) as tcp, await unix_worker.connect() as unix:
                    assert tcp.hello.pid == process.pid
                    return await generate_ids(tcp), await generate_ids(unix)

            tcp_ids, unix_ids = asyncio.run(scenario())
        finally:
            process.terminate()
            process.wait(10)
        assert len(tcp_ids) == 8
        assert tcp_ids == unix_ids
        assert not Path(address).exists()  # no socket file was made for a TCP address
