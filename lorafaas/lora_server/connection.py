"""One client connection of the LoRA server, on a non-blocking socket of its own (not an asyncio stream: a stream
drops the descriptors that come with a frame, SCM_RIGHTS, and buffers what a client does not read without bound).

Every wait that a client controls has a limit, so a client that stalls costs the server nothing but its own
connection: its hello must arrive within `hello_timeout_s`, a frame once begun must be complete within
`frame_timeout_s` (an idle connection between frames is fine: a function may be idle for hours), inline rows must keep
arriving at a minimum rate, and a reply must be taken (sent whole) within `send_timeout_s`, so a client that never
reads is hung up on instead of holding the server's memory. All raise `ClientStalled`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket

from lorafaas.wire import FRAME_HEADER_BYTES, frame_length

MAX_FDS = 4  # descriptors accepted with one frame (more: the frame is refused)
MIN_INLINE_BYTES_PER_S = 1 << 20  # inline rows slower than this are a stall


class ClientStalled(Exception):
    """A client did not send or take its bytes within the limit."""


class ClientGone(Exception):
    """The client closed the connection (cleanly between frames, or in the middle of one)."""


class Connection:
    def __init__(self, sock: socket.socket, *, frame_timeout_s: float, send_timeout_s: float) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.unix = sock.family == socket.AF_UNIX
        self.frame_timeout_s = frame_timeout_s
        self.send_timeout_s = send_timeout_s
        self._loop = asyncio.get_running_loop()

    async def read_frame(self, first_byte_timeout_s: float | None) -> tuple[bytes, list[int]] | None:
        """The next frame's payload and the descriptors that came with it (the caller owns them), or None at a clean
        end of stream. `first_byte_timeout_s`: how long to wait for it to begin (None: for ever)."""
        fds: list[int] = []
        try:
            first = await asyncio.wait_for(self._recv(1, fds), first_byte_timeout_s)
            if not first:
                return None
            async with asyncio.timeout(self.frame_timeout_s):
                header = first + await self._read_exactly(FRAME_HEADER_BYTES - 1, fds)
                payload = await self._read_exactly(frame_length(header), fds)
            return payload, fds
        except TimeoutError as exc:
            close_fds(fds)
            raise ClientStalled("a frame did not arrive in time") from exc
        except BaseException:
            close_fds(fds)
            raise

    async def read_payload(self, nbytes: int) -> bytearray:
        """Raw bytes that follow a frame (inline rows), at no less than `MIN_INLINE_BYTES_PER_S`."""
        data = bytearray(nbytes)
        view, done = memoryview(data), 0
        try:
            async with asyncio.timeout(self.frame_timeout_s + nbytes / MIN_INLINE_BYTES_PER_S):
                while done < nbytes:
                    got = await self._loop.sock_recv_into(self.sock, view[done:])
                    if not got:
                        raise ClientGone("the client closed the connection in the middle of its rows")
                    done += got
        except TimeoutError as exc:
            raise ClientStalled(f"{nbytes - done} of {nbytes} bytes of rows did not arrive in time") from exc
        return data

    async def send(self, *parts: bytes | memoryview) -> None:
        """Send every part whole within `send_timeout_s`, else `ClientStalled` (it does not read its replies)."""
        try:
            async with asyncio.timeout(self.send_timeout_s):
                for part in parts:
                    await self._loop.sock_sendall(self.sock, part)
        except TimeoutError as exc:
            raise ClientStalled(f"the client did not take its reply within {self.send_timeout_s:.0f} s") from exc

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    async def _read_exactly(self, n: int, fds: list[int]) -> bytes:
        chunks, remaining = [], n
        while remaining:
            chunk = await self._recv(min(remaining, 1 << 20), fds)
            if not chunk:
                raise ClientGone("the client closed the connection in the middle of a frame")
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)

    async def _recv(self, n: int, fds: list[int]) -> bytes:
        while True:
            try:
                if not self.unix:
                    return self.sock.recv(n)
                data, received, flags, _ = socket.recv_fds(self.sock, n, MAX_FDS, socket.MSG_CMSG_CLOEXEC)
                fds.extend(received)
                if flags & socket.MSG_CTRUNC or len(fds) > MAX_FDS:
                    raise ValueError(f"more than {MAX_FDS} descriptors came with one frame")
                return data
            except (BlockingIOError, InterruptedError):
                await self._readable()
            except ConnectionResetError:
                return b""

    async def _readable(self) -> None:
        future: asyncio.Future[None] = self._loop.create_future()
        fd = self.sock.fileno()

        def ready() -> None:
            if not future.done():
                future.set_result(None)

        self._loop.add_reader(fd, ready)
        try:
            await future
        finally:
            self._loop.remove_reader(fd)


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()
