"""A member of the shared base pass written by hand (`lorafaas.protocols.base_pass`), for tests that play an honest
member step by step or a hostile one: a hello with any groups, rows, dtype, buffer size and seals; calls and ENDs
when the test says; the buffer kept mapped so a test can write X and read the outputs."""

from __future__ import annotations

import fcntl
import mmap
import os
import socket

import msgspec
import torch

from lorafaas.protocols import base_pass as bp
from lorafaas.wire import FRAME_HEADER_BYTES, encode_frame, frame_length


class RawMember:
    def __init__(self, path: str, groups: tuple[bp.GroupSpec, ...] | list[bp.GroupSpec], *, max_rows: int = 4,
                 dtype: str = "float32", size: int = 64 << 20, seals: int = fcntl.F_SEAL_SHRINK,
                 timeout_s: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        self.sock.connect(path)
        self.fd = os.memfd_create("test-member", os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, size)
        # mapped before the seals: F_SEAL_WRITE then fails the executor's map
        self.buffer: mmap.mmap | None = mmap.mmap(self.fd, size)
        self.size = size
        if seals & fcntl.F_SEAL_WRITE:
            self.buffer.close()
            self.buffer = None
        if seals:
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, seals)
        socket.send_fds(self.sock, [encode_frame(bp.BasePassHello(groups=tuple(groups), max_rows=max_rows,
                                                                  dtype=dtype))], [self.fd])

    def write(self, x: torch.Tensor) -> None:
        """X [rows, in] at offset 0, for the next call."""
        flat = torch.frombuffer(self.buffer, dtype=x.dtype)
        flat[: x.numel()].copy_(x.reshape(-1))

    def read(self, offset: int, rows: int, width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[rows, width] elements from element `offset` of the buffer (an output), copied."""
        flat = torch.frombuffer(self.buffer, dtype=dtype)
        return flat[offset:offset + rows * width].view(rows, width).clone()

    def welcome(self) -> bp.BasePassWelcome:
        header = self._recv_exactly(FRAME_HEADER_BYTES)
        return msgspec.msgpack.decode(self._recv_exactly(frame_length(header)), type=bp.BasePassWelcome)

    def send_call(self, key: int, rows: int, flags: int = 0) -> None:
        self.sock.sendall(bp.HEADER.pack(key, rows, flags))

    def reply(self) -> bytes:
        """DONE, ALONE, or b"" when hung up on."""
        try:
            return self.sock.recv(1)
        except ConnectionResetError:
            return b""

    def call(self, key: int, rows: int, flags: int = 0) -> bytes:
        self.send_call(key, rows, flags)
        return self.reply()

    def end(self, again: bool) -> None:
        self.sock.sendall(bp.HEADER.pack(bp.END_KEY, 0, bp.AGAIN if again else 0))

    def close(self) -> None:
        self.sock.close()
        if self.buffer is not None:
            self.buffer.close()
        os.close(self.fd)

    def _recv_exactly(self, n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("the executor closed the connection")
            data += chunk
        return bytes(data)
