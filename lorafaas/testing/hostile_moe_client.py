"""A LoRA server client written by hand (`lorafaas.protocols.lora_server_messages`), for tests that play a hostile
MoE function against the real server: any frame, any shape, any buffer and seals, calls that are never read back,
a hello never sent or a frame never finished. Blocking sockets; every read has a timeout."""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import socket

import msgspec

from lorafaas.protocols import lora_server_messages as m
from lorafaas.wire import FRAME_HEADER_BYTES, encode_frame, frame_length


class HostileMoeClient:
    def __init__(self, address: str, *, hello: bool = True, timeout_s: float = 10.0) -> None:
        if address.startswith("tcp://"):
            host, _, port = address.removeprefix("tcp://").rpartition(":")
            self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        else:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout_s)
            self.sock.connect(address)
        self.fd: int | None = None
        self.buffer: mmap.mmap | None = None
        self.welcome: m.Welcome | None = None
        if hello:
            self.send(m.Hello(protocol_version=m.PROTOCOL_VERSION, client="hostile"))
            reply = self.recv()
            assert isinstance(reply, m.Welcome), reply
            self.welcome = reply

    # -- frames ---------------------------------------------------------------------------------------------------

    def send(self, message: msgspec.Struct, fds: list[int] | None = None) -> None:
        data = encode_frame(message)
        if fds:
            socket.send_fds(self.sock, [data], fds)
        else:
            self.sock.sendall(data)

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self) -> m.Response | None:
        """The next reply, or None once the server hung up."""
        try:
            header = self._recv_exactly(FRAME_HEADER_BYTES)
            return m.response_decoder.decode(self._recv_exactly(frame_length(header)))
        except (ConnectionError, EOFError):
            return None

    def recv_bytes(self, n: int) -> bytes:
        return self._recv_exactly(n)

    def hung_up(self, timeout_s: float) -> bool:
        """Whether the server closes this connection within `timeout_s` (what it still sends is read and dropped)."""
        self.sock.settimeout(timeout_s)
        try:
            while self.sock.recv(1 << 16):
                pass
        except ConnectionError:
            return True
        except TimeoutError:
            return False
        return True

    # -- a buffer ---------------------------------------------------------------------------------------------------

    def make_memfd(self, size: int, seals: int = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) -> int:
        """A memfd of `size` bytes with `seals`, mapped here (before the seals: F_SEAL_WRITE needs no mapping)."""
        self.fd = os.memfd_create("hostile-lora", os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, size)
        if not seals & fcntl.F_SEAL_WRITE:
            self.buffer = mmap.mmap(self.fd, size)
        if seals:
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, seals)
        return self.fd

    def attach(self, size: int, fd: int | None = None) -> m.Response | None:
        """Send AttachBuffer with `fd` (a fresh sealed memfd of `size` bytes if None) and read the reply."""
        fd = self.make_memfd(size) if fd is None else fd
        self.send(m.AttachBuffer(size=size), [fd])
        return self.recv()

    def close(self) -> None:
        self.sock.close()
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _recv_exactly(self, n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("the server closed the connection")
            data += chunk
        return bytes(data)


def flood(address: str, adapter_dir: str, *, rows: int, connections: int, seconds: float) -> dict:
    """Finding 6's flood: `connections` connections of this process each loop `rows`-row gate/up calls for
    `seconds`, through the ordinary client (the protocol followed, the volume not). Returns the calls served."""
    import threading
    import time

    import torch

    from lorafaas.errors import LorafaasError
    from lorafaas.protocols.lora_transport import LoraServerClient

    served, refused = [0] * connections, [0] * connections
    deadline = time.monotonic() + seconds

    def loop(i: int) -> None:
        with LoraServerClient.connect(address, client=f"flood-{i}", timeout_s=60) as client:
            client.register("flood", adapter_dir)
            x = torch.randn(rows, client.welcome.hidden_size)
            counts = [rows // client.welcome.num_experts] * client.welcome.num_experts
            counts[0] += rows - sum(counts)
            while time.monotonic() < deadline:
                try:
                    client.start_call("flood", 0, "gate_up_proj", x, counts).wait()
                    served[i] += 1
                except LorafaasError:
                    refused[i] += 1
                    return

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(connections)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"served": sum(served), "refused": sum(refused)}


def hold_connections(address: str, count: int) -> dict:
    """Open `count` connections and say hello on each; report how many were welcomed, then hold them until stdin
    closes (so a test can check the server while they are open)."""
    import sys

    welcomed, refused, clients = 0, 0, []
    for _ in range(count):
        try:
            clients.append(HostileMoeClient(address))
            welcomed += 1
        except (AssertionError, OSError):
            refused += 1
    print(json.dumps({"welcomed": welcomed, "refused": refused}), flush=True)
    sys.stdin.read()
    for client in clients:
        client.close()
    return {"welcomed": welcomed, "refused": refused}


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m lorafaas.testing.hostile_moe_client")
    parser.add_argument("attack", choices=("flood", "connections"))
    parser.add_argument("address")
    parser.add_argument("adapter_dir", nargs="?")
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args(argv)
    if args.attack == "connections":
        hold_connections(args.address, args.connections)
        return 0
    print(json.dumps(flood(args.address, args.adapter_dir, rows=args.rows, connections=args.connections,
                           seconds=args.seconds)), flush=True)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
