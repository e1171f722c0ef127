"""Hostile clients against the real LoRA server process (issue 36, finding 6): each attack runs beside an honest
client, whose deltas must equal its deltas alone, and the attacker alone is refused or hung up on. The attacker is
this test process speaking the protocol by hand (`lorafaas.testing.hostile_moe_client`), or a process of its own
where the server tells clients apart by process (the flood)."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from lorafaas.errors import AdapterInvalid
from lorafaas.formats.expert_adapters import write_expert_adapter
from lorafaas.lora_server.server import LoraServerConfig, spawn_lora_server
from lorafaas.protocols import lora_server_messages as m
from lorafaas.protocols.lora_transport import BUFFER_PREFIX, LoraServerClient
from lorafaas.testing.hostile_moe_client import HostileMoeClient

TIMEOUT_S = 1.0  # the test server's hello, frame and send timeouts
COUNTS = [3, 0, 5, 2]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_moe_dir: Path) -> list[Path]:
    root = tmp_path_factory.mktemp("hostile-adapters")
    return [write_expert_adapter(root / f"a{i}", tiny_moe_dir, seed=20 + i, base_model_name="tiny-moe")
            for i in range(2)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_moe_dir: Path) -> Iterator[tuple[subprocess.Popen, dict]]:
    socket_path = tmp_path_factory.mktemp("hostile-lora") / "lora.sock"
    wanted = dict(model_dir=tiny_moe_dir, socket_path=socket_path, tcp="127.0.0.1:0", capacity=4, num_threads=1,
                  hello_timeout_s=TIMEOUT_S, frame_timeout_s=TIMEOUT_S, send_timeout_s=TIMEOUT_S)
    fields = {f.name for f in dataclasses.fields(LoraServerConfig)}
    config = LoraServerConfig(**{k: v for k, v in wanted.items() if k in fields})
    log = (socket_path.parent / "server.log").open("ab")
    process, addresses = spawn_lora_server(config, stderr=log)
    try:
        yield process, addresses
    finally:
        process.terminate()
        process.wait(10)
        log.close()


class Honest:
    """An honest function's connection: fixed rows, its deltas alone, then the same calls again and again."""

    def __init__(self, address: str, adapter: Path) -> None:
        self.client = LoraServerClient.connect(address, client="honest")
        self.client.register("mine", str(adapter))
        generator = torch.Generator().manual_seed(1)
        self.rows = {"gate_up_proj": torch.randn(10, 64, generator=generator),
                     "down_proj": torch.randn(10, 128, generator=generator)}
        self.alone = self._deltas()
        self.calls = 0

    def _deltas(self) -> dict:
        return {(layer, p): self.client.start_call("mine", layer, p, x, COUNTS).wait().clone()
                for layer in (0, 1) for p, x in self.rows.items()}

    def check(self) -> None:
        deltas = self._deltas()
        for key, alone in self.alone.items():
            assert torch.equal(deltas[key], alone), key
        self.calls += len(deltas)

    def run_while(self, stop: threading.Event, errors: list) -> threading.Thread:
        def loop() -> None:
            try:
                while not stop.is_set():
                    self.check()
            except BaseException as exc:  # reported by the test
                errors.append(exc)

        thread = threading.Thread(target=loop)
        thread.start()
        return thread

    def close(self) -> None:
        self.client.close()


@pytest.fixture
def honest(server, adapters) -> Iterator[Honest]:
    client = Honest(server[1]["socket"], adapters[0])
    yield client
    client.check()  # still served, same deltas, after the attack
    client.close()
    assert server[0].poll() is None, "the LoRA server died"


def _connections(address: str) -> int:
    with LoraServerClient.connect(address) as client:
        return client.status().num_connections - 1


def _wait_for(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


# -- (1) the buffer ---------------------------------------------------------------------------------------------------


def test_no_other_process_can_open_a_clients_buffer_by_name(server, adapters, honest) -> None:
    """Today's main created a /dev/shm name and unlinked it only after the server mapped it: a process watching
    /dev/shm opened it in between and read (and wrote) the rows and deltas of another function."""
    stop, opened = threading.Event(), []

    def watch() -> None:
        while not stop.is_set():
            for name in os.listdir("/dev/shm"):
                if name.startswith(BUFFER_PREFIX):
                    with contextlib.suppress(OSError):
                        opened.append(os.open(f"/dev/shm/{name}", os.O_RDWR))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for _ in range(40):
            with LoraServerClient.connect(server[1]["socket"]) as client:
                client.register("mine", str(adapters[0]))
                client.start_call("mine", 0, "gate_up_proj", torch.zeros(4, 64), [1, 1, 1, 1]).wait()
                honest.check()
    finally:
        stop.set()
        watcher.join()
        for fd in opened:
            os.close(fd)
    assert not opened, f"another process opened {len(opened)} LoRA buffers by name"


@pytest.mark.parametrize("attack", ["no-descriptor", "unsealed", "sealed-against-writes", "smaller-than-said",
                                    "not-a-memfd", "too-big"])
def test_a_buffer_the_server_cannot_safely_map_refuses_that_client_alone(server, honest, attack, tmp_path) -> None:
    """An unsealed buffer could be shrunk under the server's mapping (SIGBUS in the server: every function's calls
    lost); one sealed against writes cannot take the deltas. Each is refused, and its client alone hung up on."""
    hostile = HostileMoeClient(server[1]["socket"])
    size = 1 << 16
    try:
        if attack == "no-descriptor":
            hostile.send(m.AttachBuffer(size=size))
            reply = hostile.recv()
        elif attack == "unsealed":
            reply = hostile.attach(size, hostile.make_memfd(size, seals=0))
        elif attack == "sealed-against-writes":
            reply = hostile.attach(size, hostile.make_memfd(size, seals=fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE))
        elif attack == "smaller-than-said":
            reply = hostile.attach(4 * size, hostile.make_memfd(size))
        elif attack == "too-big":
            reply = hostile.attach(1 << 40, hostile.make_memfd(size))
        else:
            path = tmp_path / "plain"
            path.write_bytes(bytes(size))
            fd = os.open(path, os.O_RDWR)
            try:
                reply = hostile.attach(size, fd)
            finally:
                os.close(fd)
        honest.check()
        assert isinstance(reply, m.ErrorReply), reply
        assert hostile.hung_up(10.0)
    finally:
        hostile.close()


def test_an_attached_buffer_cannot_be_shrunk_under_the_server(server, honest) -> None:
    hostile = HostileMoeClient(server[1]["socket"])
    try:
        assert isinstance(hostile.attach(1 << 16), m.BufferAttached)
        with pytest.raises(PermissionError):
            os.ftruncate(hostile.fd, 0)
        honest.check()
    finally:
        hostile.close()


# -- (2) flooding -------------------------------------------------------------------------------------------------


def test_a_flooding_client_is_charged_its_calls_and_others_are_not_starved(server, adapters, honest) -> None:
    """Another process loops 16384-row calls on four connections. The honest client, in the same time, is served
    at least a quarter of the calls it is served alone (a generous bound: with the budget the flooder gets at most
    half of the compute thread; on today's main every batch carried four flood calls)."""
    seconds = 3.0
    stop, errors = threading.Event(), []
    thread = honest.run_while(stop, errors)
    time.sleep(seconds)
    stop.set()
    thread.join()
    alone = honest.calls
    flooder = subprocess.Popen(
        [sys.executable, "-m", "lorafaas.testing.hostile_moe_client", "flood", server[1]["socket"], str(adapters[1]),
         "--rows", "16384", "--connections", "4", "--seconds", str(seconds + 4)],
        stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(2.0)  # its connections are up and flooding
        stop.clear()
        honest.calls = 0
        thread = honest.run_while(stop, errors)
        time.sleep(seconds)
        stop.set()
        thread.join()
        out, _ = flooder.communicate(timeout=120)
    finally:
        flooder.kill()
        flooder.wait()
    assert not errors, errors
    report = json.loads(out)
    assert report["served"] > 0  # it was served, within its budget
    assert honest.calls >= alone / 4, (honest.calls, alone, report)


# -- (3) odd shapes ---------------------------------------------------------------------------------------------------


def _call(**fields) -> m.LoraCall:
    call = dict(seq=1, adapter_id="mine", layer=0, projection="gate_up_proj", dtype="float32",
                expert_counts=(1, 0, 0, 0), rows=m.ShmPayload(offset=0), result_offset=4096)
    call.update(fields)
    return m.LoraCall(**call)


ODD_CALLS = {
    "negative-count": _call(expert_counts=(2, -1, 0, 0)),
    "too-few-experts": _call(expert_counts=(1, 0)),
    "a-million-experts": _call(expert_counts=(1,) * 1_000_000),
    "huge-rows": _call(expert_counts=(1 << 40, 0, 0, 0)),
    "no-rows": _call(expert_counts=(0, 0, 0, 0)),
    "layer-not-adapted": _call(layer=1 << 62),
    "other-dtype": _call(dtype="float16"),
    "negative-offset": _call(rows=m.ShmPayload(offset=-64)),
    "unaligned-offset": _call(rows=m.ShmPayload(offset=3)),
    "past-the-buffer": _call(result_offset=1 << 40),
    "rows-over-result": _call(result_offset=0),
    "no-result-offset": _call(result_offset=None),
    "unregistered-adapter": _call(adapter_id="nobody"),
}


@pytest.mark.parametrize("name", sorted(ODD_CALLS))
def test_an_odd_call_is_an_error_for_its_client_alone(server, adapters, honest, name) -> None:
    hostile = HostileMoeClient(server[1]["socket"])
    try:
        assert isinstance(hostile.attach(1 << 16), m.BufferAttached)
        fd = os.open(adapters[1], os.O_RDONLY | os.O_DIRECTORY)
        try:
            hostile.send(m.RegisterAdapter(adapter_id="mine", adapter_dir=str(adapters[1])), [fd])
        finally:
            os.close(fd)
        assert isinstance(hostile.recv(), m.AdapterRegistered)
        hostile.send(ODD_CALLS[name])
        reply = hostile.recv()
        assert isinstance(reply, m.ErrorReply), reply
        honest.check()
        hostile.send(_call(seq=2))  # the connection still serves a good call
        reply = hostile.recv()
        assert isinstance(reply, m.LoraResult) and reply.seq == 2, reply
    finally:
        hostile.close()


@pytest.mark.parametrize("name", ["garbage", "huge-frame", "unknown-projection", "inline-on-unix",
                                  "inline-bytes-not-sent", "inline-bytes-not-the-rows"])
def test_a_malformed_stream_hangs_up_on_its_client_alone(server, adapters, honest, name) -> None:
    address = server[1]["socket"] if name in ("garbage", "huge-frame", "inline-on-unix") else server[1]["tcp"]
    hostile = HostileMoeClient(address)
    try:
        if hostile.sock.family != socket.AF_UNIX:  # TCP: the adapter by path
            hostile.send(m.RegisterAdapter(adapter_id="theirs", adapter_dir=str(adapters[1])))
            assert isinstance(hostile.recv(), m.AdapterRegistered)
        if name == "garbage":
            hostile.send_raw(b"\x00\x00\x00\x05hello")
        elif name == "huge-frame":
            hostile.send_raw(b"\x7f\xff\xff\xff")
        elif name == "unknown-projection":
            payload = msgspec.msgpack.encode({"type": "lora_call", "seq": 1, "projection": "q_proj"})
            hostile.send_raw(len(payload).to_bytes(4, "big") + payload)
        elif name == "inline-on-unix":
            hostile.send(_call(rows=m.InlinePayload(nbytes=64 * 4), result_offset=None))
            with contextlib.suppress(OSError):  # hung up on at the frame already
                hostile.send_raw(bytes(64 * 4))
        elif name == "inline-bytes-not-sent":  # 512 MiB announced for one row: refused before they are read
            hostile.send(_call(adapter_id="theirs", rows=m.InlinePayload(nbytes=1 << 29), result_offset=None))
        else:
            hostile.send(_call(adapter_id="theirs", rows=m.InlinePayload(nbytes=128), result_offset=None))
            hostile.send_raw(bytes(128))
        reply = hostile.recv()
        assert isinstance(reply, m.ErrorReply), reply
        honest.check()
        assert hostile.hung_up(10.0)
    finally:
        hostile.close()


# -- (4) a client that never reads ------------------------------------------------------------------------------------


def test_a_client_that_never_reads_its_replies_is_hung_up_on(server, adapters, honest) -> None:
    """Calls pushed over TCP without reading one result: the server's sends stall, then it hangs up on that client
    (send timeout); the honest client is served the whole time."""
    before = _connections(server[1]["socket"])
    hostile = HostileMoeClient(server[1]["tcp"], timeout_s=30)
    stop, errors = threading.Event(), []
    try:
        hostile.send(m.RegisterAdapter(adapter_id="theirs", adapter_dir=str(adapters[1])))
        assert isinstance(hostile.recv(), m.AdapterRegistered)
        rows = 2048
        call = m.LoraCall(seq=0, adapter_id="theirs", layer=0, projection="gate_up_proj", dtype="float32",
                          expert_counts=(rows, 0, 0, 0), rows=m.InlinePayload(nbytes=rows * 64 * 4))

        def push() -> None:
            try:
                for _ in range(200):  # 2 MiB of deltas each, never read
                    hostile.send(call)
                    hostile.send_raw(bytes(rows * 64 * 4))
            except OSError:
                pass  # hung up on

        pusher = threading.Thread(target=push)
        pusher.start()
        thread = honest.run_while(stop, errors)
        assert _wait_for(lambda: _connections(server[1]["socket"]) <= before), "the never-reading client stays"
        stop.set()
        thread.join()
        pusher.join(60)
        assert not errors, errors
    finally:
        stop.set()
        hostile.close()


# -- (5) silence ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["no-hello", "half-a-hello", "half-a-request"])
def test_a_silent_or_slow_client_is_hung_up_on(server, honest, name) -> None:
    hostiles = []
    try:
        for _ in range(8):
            hostile = HostileMoeClient(server[1]["socket"], hello=name == "half-a-request", timeout_s=30)
            hostiles.append(hostile)
            if name != "no-hello":
                hostile.send_raw(b"\x00\x00\x00\x20\x81")
        honest.check()
        for hostile in hostiles:
            assert hostile.hung_up(10 * TIMEOUT_S + 5)
        honest.check()
    finally:
        for hostile in hostiles:
            hostile.close()


# -- adapters ---------------------------------------------------------------------------------------------------------


def test_a_client_cannot_call_or_register_another_functions_adapter(server, adapters, honest) -> None:
    """The honest client registered adapters[0] as "mine". Another client can neither call that id (adapters are
    bound to the connection that registered them) nor register adapters[0] by naming its path: over the Unix socket
    the server reads an adapter only through a descriptor of its directory that the client sends."""
    address = server[1]["socket"]
    hostile = HostileMoeClient(address)
    try:
        assert isinstance(hostile.attach(1 << 16), m.BufferAttached)
        hostile.send(_call())
        reply = hostile.recv()
        assert isinstance(reply, m.ErrorReply) and reply.code == AdapterInvalid.code, reply
        hostile.send(m.RegisterAdapter(adapter_id="mine", adapter_dir=str(adapters[0])))  # by path alone
        reply = hostile.recv()
        assert isinstance(reply, m.ErrorReply), reply
        hostile.send(_call(seq=3))
        reply = hostile.recv()
        assert isinstance(reply, m.ErrorReply) and reply.code == AdapterInvalid.code, reply
        honest.check()
    finally:
        hostile.close()
    # Its own adapter under the honest client's id is its own: the honest client's deltas do not change.
    with LoraServerClient.connect(address) as other:
        other.register("mine", str(adapters[1]))
        theirs = other.start_call("mine", 0, "gate_up_proj", honest.rows["gate_up_proj"], COUNTS).wait().clone()
        honest.check()
        assert not torch.equal(theirs, honest.alone[0, "gate_up_proj"])


def test_a_client_cannot_stop_the_server(server, honest) -> None:
    """Shutdown needs the token the server printed in its ready line (the node agent has it, no function does)."""
    hostile = HostileMoeClient(server[1]["socket"])
    try:
        hostile.send(m.Shutdown())
        reply = hostile.recv()
        assert isinstance(reply, m.ErrorReply), reply
        honest.check()
    finally:
        hostile.close()
    assert server[0].poll() is None


def test_a_process_holding_many_connections_is_refused_past_its_cap(server, honest) -> None:
    """Another process opens 40 connections (each one descriptor of the server's): past 32 it is refused, and other
    processes still connect and are served."""
    holder = subprocess.Popen([sys.executable, "-m", "lorafaas.testing.hostile_moe_client", "connections",
                               server[1]["socket"], "--connections", "40"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        report = json.loads(holder.stdout.readline())
        assert report == {"welcomed": 32, "refused": 8}, report
        with LoraServerClient.connect(server[1]["socket"]) as other:  # this process: its own cap
            assert other.status().num_connections >= 33
        honest.check()
    finally:
        holder.stdin.close()
        holder.wait(30)


def test_a_link_swapped_into_a_registered_directory_does_not_reach_another_adapter(
    server, adapters, honest, tmp_path
) -> None:
    """A client that can write its own adapter directory registers it, then swaps its weights for a link to another
    adapter's (layers are read on first call): the server opens the weights through the directory's descriptor
    without following links, so the call fails and never carries the other adapter's deltas."""
    from lorafaas.errors import LorafaasError
    from lorafaas.formats.adapter_files import WEIGHTS_FILE

    mine = tmp_path / "mine"
    shutil.copytree(adapters[1], mine)
    with LoraServerClient.connect(server[1]["socket"]) as client:
        client.register("x", str(mine))
        (mine / WEIGHTS_FILE).unlink()
        (mine / WEIGHTS_FILE).symlink_to(adapters[0] / WEIGHTS_FILE)
        try:
            delta = client.start_call("x", 0, "gate_up_proj", honest.rows["gate_up_proj"], COUNTS).wait().clone()
        except LorafaasError:
            delta = None
        assert delta is None or not torch.equal(delta, honest.alone[0, "gate_up_proj"]), "another adapter's deltas"
        assert client.status().server_pid == server[0].pid  # the connection goes on
    honest.check()


def test_a_process_cannot_hold_more_than_its_share_of_adapter_descriptors(server, adapters, honest, tmp_path) -> None:
    """Each adapter registered over the Unix socket holds a directory descriptor of the server's: one process
    registering distinct directories on two connections is refused at 64 in all (the honest client's one included),
    so no client runs the server out of descriptors."""
    from lorafaas.errors import InvalidInput

    registered = 0
    with LoraServerClient.connect(server[1]["socket"]) as one, LoraServerClient.connect(server[1]["socket"]) as two:
        for i in range(80):
            directory = tmp_path / f"copy{i}"
            shutil.copytree(adapters[1], directory)
            try:
                (one if i < 40 else two).register(f"c{i}", str(directory))
                registered += 1
            except InvalidInput as exc:
                assert "registered already" in str(exc)
        assert registered == 63, registered
        honest.check()
    with LoraServerClient.connect(server[1]["socket"]) as three:  # given back with their connections
        three.register("again", str(adapters[1]))
