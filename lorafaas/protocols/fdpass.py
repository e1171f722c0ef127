"""Frames that carry file descriptors over a Unix stream socket (SCM_RIGHTS), for asyncio writers and blocking readers.

The descriptors ride on the first byte of the frame (one `sendmsg`); the kernel never merges a read across that
boundary, so the reader collects them while it reads the frame. Received descriptors are owned by the caller, which
must close those it does not keep (`close_fds`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from typing import TypeVar

import msgspec

from lorafaas.wire import FRAME_HEADER_BYTES, encode_frame, frame_length

T = TypeVar("T")
MAX_FDS = 4


async def send_with_fds(writer: asyncio.StreamWriter, message: msgspec.Struct, fds: list[int]) -> None:
    """Write one frame with `fds` attached. The transport's buffer is drained first, so bytes stay in order."""
    data = encode_frame(message)
    await writer.drain()
    transport_socket = writer.get_extra_info("socket")
    # A socket object of our own over the same connection (a dup shares the open file description, non-blocking).
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(transport_socket.fileno()))
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        while True:
            try:
                sent = socket.send_fds(sock, [data], fds)
                break
            except BlockingIOError:
                writable = loop.create_future()
                loop.add_writer(sock.fileno(), writable.set_result, None)
                try:
                    await writable
                finally:
                    loop.remove_writer(sock.fileno())
        if sent < len(data):
            await loop.sock_sendall(sock, data[sent:])
    finally:
        sock.close()


def recv_with_fds(sock: socket.socket, decoder: msgspec.msgpack.Decoder[T]) -> tuple[T, list[int]]:
    """Blocking read of one frame and the descriptors that came with it; ConnectionError if the peer closed."""
    fds: list[int] = []
    try:
        header = _recv_exactly(sock, FRAME_HEADER_BYTES, fds)
        payload = _recv_exactly(sock, frame_length(header), fds)
        return decoder.decode(payload), fds
    except BaseException:
        close_fds(fds)
        raise


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _recv_exactly(sock: socket.socket, n: int, fds: list[int]) -> bytes:
    chunks, remaining = [], n
    while remaining:
        chunk, received, flags, _addr = socket.recv_fds(
            sock, min(remaining, 1 << 20), MAX_FDS, socket.MSG_CMSG_CLOEXEC
        )
        fds.extend(received)
        if flags & socket.MSG_CTRUNC:
            raise ConnectionError(f"more than {MAX_FDS} descriptors arrived with one frame; some were dropped")
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)
