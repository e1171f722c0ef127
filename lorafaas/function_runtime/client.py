"""The one wrapper every caller (node agent, benchmarks, tests) uses to talk to a function worker.

    async with await WorkerClient.connect(socket_path) as worker:
        await worker.stage("backbone")
        async for event in worker.generate(m.Generate(request_id="r1", prompt="Hi")):
            ...                                   # m.Token events, then one m.Finished

One connection multiplexes many generations; control calls (stage, unstage, stats) are serialised and answered in
order. Errors the worker reports are raised as the LorafaasError class that produced them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec

from lorafaas.errors import InstanceUnavailable, InvalidInput, LorafaasError, ProtocolError
from lorafaas.function_runtime import messages as m
from lorafaas.wire import encode_frame, error_class, read_message

reply_decoder = msgspec.msgpack.Decoder(m.Reply)
_END = object()  # end of a generation's event queue when the connection drops
TCP_SCHEME = "tcp://"


def tcp_address(address: str) -> tuple[str, int] | None:
    """(host, port) of a `tcp://HOST:PORT` worker address; None for a Unix socket path."""
    if not address.startswith(TCP_SCHEME):
        return None
    host, _, port = address[len(TCP_SCHEME) :].rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidInput(f"worker address {address!r} is not tcp://HOST:PORT")
    return host.strip("[]"), int(port)


class WorkerClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hello: m.HelloReply) -> None:
        self._reader = reader
        self._writer = writer
        self.hello = hello
        self._control = asyncio.Lock()
        self._control_replies: asyncio.Queue = asyncio.Queue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._pump = asyncio.create_task(self._read_replies())

    @classmethod
    async def connect(cls, socket_path: str | Path, *, client: str = "", timeout_s: float = 10.0) -> WorkerClient:
        try:
            tcp = tcp_address(str(socket_path))
            opening = asyncio.open_connection(*tcp) if tcp else asyncio.open_unix_connection(str(socket_path))
            reader, writer = await asyncio.wait_for(opening, timeout_s)
        except (OSError, TimeoutError) as exc:
            raise InstanceUnavailable(f"no function worker is listening at {socket_path} ({exc})") from exc
        writer.write(encode_frame(m.Hello(version=m.PROTOCOL_VERSION, client=client)))
        reply = await asyncio.wait_for(read_message(reader, reply_decoder), timeout_s)
        if not isinstance(reply, m.HelloReply):
            writer.close()
            message = reply.message if isinstance(reply, m.ErrorReply) else f"unexpected {reply!r}"
            raise ProtocolError(f"worker at {socket_path} refused the handshake: {message}")
        return cls(reader, writer, reply)

    async def __aenter__(self) -> WorkerClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def wait_closed(self) -> None:
        """Return when the worker's connection ends (the worker exited, crashed or closed it)."""
        try:
            await asyncio.shield(self._pump)
        except asyncio.CancelledError:
            if not self._pump.done():  # the caller was cancelled, not the pump
                raise

    @property
    def connected(self) -> bool:
        return not self._pump.done()

    async def close(self) -> None:
        self._pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._pump
        self._writer.close()
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()

    # -- control -------------------------------------------------------------------------------------------------

    async def stage(self, stage: m.StageName) -> m.StageDone:
        return await self._call(m.Stage(stage), m.StageDone)

    async def unstage(self, stage: m.UnstageName) -> m.StageDone:
        return await self._call(m.Unstage(stage), m.StageDone)

    async def stats(self) -> m.Stats:
        return await self._call(m.GetStats(), m.Stats)

    async def shutdown(self) -> None:
        await self._send(m.Shutdown())

    async def _send(self, request: msgspec.Struct) -> None:
        try:
            self._writer.write(encode_frame(request))
            await self._writer.drain()
        except (ConnectionError, OSError) as exc:
            raise InstanceUnavailable(f"function worker {self.hello.instance_id} went away: {exc}") from exc

    async def _call(self, request: msgspec.Struct, expected: type):
        async with self._control:
            await self._send(request)
            reply = await self._control_replies.get()
        if reply is _END:
            raise InstanceUnavailable(f"function worker {self.hello.instance_id} closed the connection")
        if isinstance(reply, m.ErrorReply):
            raise _error(reply)
        if not isinstance(reply, expected):
            raise ProtocolError(f"expected {expected.__name__}, got {type(reply).__name__}")
        return reply

    # -- generation ----------------------------------------------------------------------------------------------

    async def generate(self, request: m.Generate) -> AsyncIterator[m.Token | m.Finished]:
        """Yield the request's Token events and then its Finished; cancels the request if the caller stops early."""
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request.request_id] = queue
        finished = False
        try:
            await self._send(request)
            while True:
                event = await queue.get()
                if event is _END:
                    raise InstanceUnavailable(
                        f"function worker {self.hello.instance_id} went away during request {request.request_id}"
                    )
                if isinstance(event, m.ErrorReply):
                    finished = True
                    raise _error(event)
                finished = isinstance(event, m.Finished)  # before yielding: the caller may stop right here
                yield event
                if finished:
                    return
        finally:
            self._streams.pop(request.request_id, None)
            if not finished and not self._writer.is_closing():
                self._writer.write(encode_frame(m.Cancel(request.request_id)))

    async def cancel(self, request_id: str) -> None:
        await self._send(m.Cancel(request_id))

    async def _read_replies(self) -> None:
        try:
            while (reply := await read_message(self._reader, reply_decoder)) is not None:
                request_id = getattr(reply, "request_id", None)
                if request_id is not None and request_id in self._streams:
                    self._streams[request_id].put_nowait(reply)
                elif request_id is None:
                    self._control_replies.put_nowait(reply)
        except (OSError, asyncio.IncompleteReadError, msgspec.DecodeError):
            pass
        finally:
            for queue in self._streams.values():
                queue.put_nowait(_END)
            self._control_replies.put_nowait(_END)


def _error(reply: m.ErrorReply) -> LorafaasError:
    error = error_class(reply.code)(reply.message)
    if reply.param is not None:
        error.param = reply.param  # type: ignore[attr-defined]  # InvalidInput's (the only errors that carry one)
    return error
