"""Framing shared by every lorafaas socket protocol: a 4-byte big-endian length, then one msgpack message.

Each protocol keeps its own typed messages (`*/messages.py`); this module only moves frames, for asyncio streams and
for blocking sockets, and maps error codes sent over a socket back to the LorafaasError classes that raised them.
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import TypeVar

import msgspec

from lorafaas import errors

FRAME_HEADER_BYTES = 4
MAX_FRAME_BYTES = 16 * 1024 * 1024

T = TypeVar("T")
_encoder = msgspec.msgpack.Encoder()


def encode_frame(message: msgspec.Struct) -> bytes:
    payload = _encoder.encode(message)
    return len(payload).to_bytes(FRAME_HEADER_BYTES, "big") + payload


def frame_length(header: bytes) -> int:
    """The payload length announced by a frame header; raises ValueError beyond MAX_FRAME_BYTES."""
    length = int.from_bytes(header, "big")
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {length} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    return length


async def read_message(reader: asyncio.StreamReader, decoder: msgspec.msgpack.Decoder[T]) -> T | None:
    """The next message, or None at a clean end of stream. Raises ValueError/msgspec errors on garbage."""
    try:
        header = await reader.readexactly(FRAME_HEADER_BYTES)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise
        return None
    return decoder.decode(await reader.readexactly(frame_length(header)))


def recv_message(sock: socket.socket, decoder: msgspec.msgpack.Decoder[T]) -> T:
    """Blocking read of one message; raises ConnectionError if the peer closed the socket."""
    return decoder.decode(_recv_exactly(sock, frame_length(_recv_exactly(sock, FRAME_HEADER_BYTES))))


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks, remaining = [], n
    while remaining:
        chunk = sock.recv(min(remaining, 1 << 20))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def error_class(code: str) -> type[errors.LorafaasError]:
    """The LorafaasError subclass whose `code` this is (ServerError for unknown codes)."""
    pending: list[type[errors.LorafaasError]] = [errors.LorafaasError]
    while pending:
        cls = pending.pop(0)
        if cls.code == code and cls is not errors.LorafaasError:
            return cls
        pending.extend(cls.__subclasses__())
    return errors.ServerError


def call_unix(socket_path: str | os.PathLike, messages: list[msgspec.Struct],
              decoder: msgspec.msgpack.Decoder[T] | None, peer: str, timeout_s: float) -> T | None:
    """One request on a fresh connection to a Unix socket: send `messages` (a hello, then the request), read one
    reply (none when `decoder` is None). InstanceUnavailable names `peer` when nothing listens there."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(os.fspath(socket_path))
        except OSError as exc:
            raise errors.InstanceUnavailable(f"no {peer} is listening at {socket_path} ({exc})") from exc
        sock.sendall(b"".join(encode_frame(message) for message in messages))
        return None if decoder is None else recv_message(sock, decoder)
