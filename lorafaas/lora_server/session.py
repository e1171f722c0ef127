"""One client connection of the LoRA server, from accept to hang-up: the hello, the client's buffer, its adapters
and its calls. Whatever this client does wrong ends here, for this client alone:

- a request the server can answer while staying in step with the stream (an unknown adapter id, an odd shape, a
  call that does not fit its buffer) gets an `ErrorReply` and the connection goes on;
- a stream it cannot follow (a frame that does not decode, inline rows it cannot skip, descriptors where none
  belong), a buffer it cannot safely map, a stall (`connection.py`) or any other failure while serving this
  connection hangs up on it (an `ErrorReply` first where it still reads), and counts in `num_refused`.

A buffer is accepted only as a memfd sealed against shrinking (a shrink under the server's mapping would fault the
server, SIGBUS, and every function's calls with it) and not against writes (the deltas go there), of at most
`MAX_BUFFER_BYTES`; the server maps it and closes the descriptor (`shared_mapping.map_shared`), then seals it
against growing and further seals.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import hmac
import logging
import os
import socket
import time
from typing import Protocol

import msgspec
import torch

from lorafaas.errors import AdapterIncompatible, InvalidInput, LorafaasError, ProtocolError, ServerError
from lorafaas.formats.expert_adapters import ExpertLayout
from lorafaas.lora_server.adapters import AdapterRegistry, ConnectionAdapters
from lorafaas.lora_server.client_policy import ClientLimits, ClientPolicy, Peer
from lorafaas.lora_server.compute import LoraWork
from lorafaas.lora_server.connection import ClientGone, ClientStalled, Connection, close_fds
from lorafaas.protocols import lora_server_messages as m
from lorafaas.protocols.leases import socket_peer_pid
from lorafaas.protocols.lora_transport import MAX_BUFFER_BYTES, TORCH_DTYPES, buffer_view
from lorafaas.protocols.shared_mapping import map_shared
from lorafaas.wire import encode_frame

log = logging.getLogger(__name__)
MAX_ROWS_PER_CALL = 1 << 16
MAX_CALL_BYTES = 1 << 30  # rows and deltas of one call
F_SEAL_FUTURE_WRITE = 0x0010  # linux/fcntl.h (Python's fcntl names it from 3.14 only)


class _Config(Protocol):
    @property
    def device(self) -> str: ...

    @property
    def dtype(self) -> m.DType: ...

    @property
    def limits(self) -> ClientLimits: ...


class SessionHost(Protocol):
    """What a session needs of the server (`LoraServer`)."""

    @property
    def config(self) -> _Config: ...

    layout: ExpertLayout
    registry: AdapterRegistry
    policy: ClientPolicy
    token: str
    num_refused: int
    num_connections: int

    async def submit(self, work: LoraWork, peer: Peer) -> None: ...

    def status(self, own: dict[str, str] | None = None) -> m.ServerStatus: ...

    def forget(self, keys: list[str]) -> None: ...

    def stop(self) -> None: ...


class Refused(Exception):
    """Hang up on this client (after telling it why)."""


class ServerBuffer:
    """A client's memfd, mapped here without keeping its descriptor; raises ValueError or OSError to refuse it."""

    def __init__(self, fd: int, size: int) -> None:
        if not 0 < size <= MAX_BUFFER_BYTES:
            raise ValueError(f"a buffer of {size} bytes; it must hold 1 to {MAX_BUFFER_BYTES}")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as exc:
            raise ValueError("the descriptor is not a memfd") from exc
        if not seals & fcntl.F_SEAL_SHRINK:
            raise ValueError("the buffer must be a memfd sealed against shrinking (F_SEAL_SHRINK)")
        if seals & (fcntl.F_SEAL_WRITE | F_SEAL_FUTURE_WRITE):
            raise ValueError("the buffer is sealed against writes: the server writes the deltas there")
        if os.fstat(fd).st_size < size:
            raise ValueError(f"the buffer holds {os.fstat(fd).st_size} bytes, not the {size} it said")
        self._mapping: ctypes.Array | None = map_shared(fd, size)
        with contextlib.suppress(OSError):  # never longer either, and no seal added from now on
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        self.size = size
        self._bytes = torch.frombuffer(self._mapping, dtype=torch.uint8)

    def tensor(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return buffer_view(self._bytes, self.size, offset, dtype, shape)


class Session:
    def __init__(self, server: SessionHost, sock: socket.socket, transport: str) -> None:
        self.server = server
        self.transport = transport  # "shm" (Unix socket) | "tcp"
        limits = server.config.limits
        self.conn = Connection(sock, frame_timeout_s=limits.frame_timeout_s, send_timeout_s=limits.send_timeout_s)
        self.adapters = ConnectionAdapters(server.registry)
        self.buffer: ServerBuffer | None = None
        if transport == "shm":
            pid = socket_peer_pid(sock)
            self.peer: Peer = ("pid", pid) if pid else ("connection", id(self))
        else:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small frames: no Nagle delay
            self.peer = ("tcp", *sock.getpeername()[:2])
        self.name = f"{self.peer[0]} {self.peer[1]}"

    async def run(self) -> None:
        server = self.server
        if not server.policy.connect(self.peer, time.monotonic()):
            server.num_refused += 1
            with contextlib.suppress(Exception):
                await self.conn.send(encode_frame(m.ErrorReply(
                    code=InvalidInput.code,
                    message=f"{server.config.limits.max_connections} connections of this client are open already")))
            self.conn.close()
            return
        server.num_connections += 1
        try:
            await self._serve()
        except (ClientGone, ConnectionError):
            pass
        except ClientStalled as exc:
            self._hang_up(f"it stalled: {exc}")
        except (Refused, ProtocolError, msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
            message = exc.message if isinstance(exc, LorafaasError) else str(exc)
            self._hang_up(message)
            await self._try_reply(m.ErrorReply(code=ProtocolError.code, message=message))
        except Exception as exc:  # any other failure serving this connection: this client alone is hung up on
            log.exception("LoRA server: serving %s failed", self.name)
            self._hang_up(repr(exc))
            await self._try_reply(m.ErrorReply(code=ServerError.code, message=f"the LoRA server failed: {exc!r}"))
        finally:
            server.num_connections -= 1
            self.buffer = None  # unmapped once the last view of it goes (`map_shared`)
            server.policy.give_adapters(self.peer, len(self.adapters.ids))
            server.forget(self.adapters.release_all())
            server.policy.disconnect(self.peer)
            self.conn.close()

    def _hang_up(self, why: str) -> None:
        self.server.num_refused += 1
        log.warning("LoRA server: hanging up on %s: %s", self.name, why)

    async def _try_reply(self, message: msgspec.Struct) -> None:
        with contextlib.suppress(Exception):
            await self.conn.send(encode_frame(message))

    async def _serve(self) -> None:
        limits = self.server.config.limits
        frame = await self.conn.read_frame(limits.hello_timeout_s)
        if frame is None:
            return
        payload, fds = frame
        close_fds(fds)
        hello = m.request_decoder.decode(payload)
        if not isinstance(hello, m.Hello) or hello.protocol_version != m.PROTOCOL_VERSION:
            raise ProtocolError(f"expected hello with protocol version {m.PROTOCOL_VERSION}, got {hello!r}")
        if hello.client:
            self.name += f" ({hello.client[:80]})"
        await self.conn.send(encode_frame(self._welcome()))
        while (frame := await self.conn.read_frame(None)) is not None:
            payload, fds = frame
            try:
                await self._request(m.request_decoder.decode(payload), fds)
            finally:
                close_fds(fds)  # those a handler keeps it takes out of the list

    def _welcome(self) -> m.Welcome:
        layout, config = self.server.layout, self.server.config
        return m.Welcome(
            protocol_version=m.PROTOCOL_VERSION,
            server_pid=os.getpid(),
            device=config.device,
            dtype=config.dtype,
            num_experts=layout.num_experts,
            hidden_size=layout.hidden_size,
            intermediate_size=layout.intermediate_size,
            layers=tuple(sorted(layout.experts_paths)),
        )

    async def _request(self, request: m.Request, fds: list[int]) -> None:
        if fds and not isinstance(request, m.AttachBuffer | m.RegisterAdapter):
            raise Refused(f"descriptors came with a {type(request).__name__}")
        try:
            if isinstance(request, m.LoraCall):
                await self._call(request)
            elif isinstance(request, m.AttachBuffer):
                self._attach(request, fds)
                await self.conn.send(encode_frame(m.BufferAttached(size=request.size)))
            elif isinstance(request, m.RegisterAdapter):
                info = self._register(request, fds)
                await self.conn.send(encode_frame(m.AdapterRegistered(
                    adapter_id=request.adapter_id, rank=info.rank, expert_bytes=info.expert_bytes)))
            elif isinstance(request, m.Status):
                await self.conn.send(encode_frame(self.server.status(self.adapters.ids)))
            elif isinstance(request, m.Shutdown):
                if not hmac.compare_digest(request.token.encode(), self.server.token.encode()):
                    raise InvalidInput("Shutdown needs the server's token (its ready line); functions have none")
                await self.conn.send(encode_frame(m.ShuttingDown()))
                self.server.stop()
            else:
                raise ProtocolError(f"unexpected {type(request).__name__} after the handshake")
        except LorafaasError as exc:
            if isinstance(exc, ProtocolError):
                raise
            seq = request.seq if isinstance(request, m.LoraCall) else None
            await self.conn.send(encode_frame(m.ErrorReply(code=exc.code, message=exc.message, seq=seq)))

    def _attach(self, request: m.AttachBuffer, fds: list[int]) -> None:
        if self.transport != "shm":
            raise Refused("shared-memory buffers are for local (Unix socket) connections")
        if len(fds) != 1:
            raise Refused(f"AttachBuffer carries one descriptor (a memfd), not {len(fds)}")
        try:
            buffer = ServerBuffer(fds[0], request.size)
        except (OSError, ValueError) as exc:  # any failure to take the buffer refuses this client alone
            raise Refused(f"its buffer cannot be used: {exc}") from exc
        self.buffer = buffer  # the previous one (a smaller buffer) is unmapped with its last view

    def _register(self, request: m.RegisterAdapter, fds: list[int]):
        fd = None
        if self.transport == "shm":
            if len(fds) != 1:
                raise InvalidInput("on the Unix socket, RegisterAdapter carries a descriptor of the adapter's "
                                   "directory; the server reads no adapter by a path a client names")
            fd = fds.pop()  # the registry owns it now
        new = request.adapter_id not in self.adapters.ids
        if new and not self.server.policy.take_adapter(self.peer, time.monotonic()):
            if fd is not None:
                os.close(fd)
            raise InvalidInput(f"this client has {self.server.config.limits.max_adapters} adapters registered "
                               "already (across its connections)")
        try:
            return self.adapters.register(request.adapter_id, request.adapter_dir, fd)
        except BaseException:
            if new:
                self.server.policy.give_adapters(self.peer, 1)
            raise

    async def _call(self, call: m.LoraCall) -> None:
        source = call.rows
        inline = isinstance(source, m.InlinePayload)
        if inline and self.transport != "tcp":
            raise ProtocolError("inline rows on a Unix socket connection (its rows go in its buffer)")
        try:
            num_rows, in_features, out_features = self._check_shape(call)
        except LorafaasError as exc:
            if inline:  # the rows that follow cannot be told from the next frame: hang up
                raise ProtocolError(f"{exc.message} (and its inline rows cannot be skipped)") from exc
            raise
        dtype = TORCH_DTYPES[call.dtype]
        data = None
        if isinstance(source, m.InlinePayload):
            expected = num_rows * in_features * dtype.itemsize
            if source.nbytes != expected:
                raise ProtocolError(f"{source.nbytes} bytes of inline rows announced; {num_rows} rows x "
                                    f"{in_features} {call.dtype} are {expected}")
            data = await self.conn.read_payload(expected)  # read before the adapter's checks: stay in step
        key = self.adapters.key(call.adapter_id)
        if call.projection not in self.server.registry.info(key).projections.get(call.layer, ()):
            raise AdapterIncompatible(
                f"adapter {call.adapter_id!r} does not adapt {call.projection} of layer {call.layer}")
        result_offset = call.result_offset
        if data is not None:
            rows = torch.frombuffer(data, dtype=dtype).view(num_rows, in_features)
            result = torch.empty(num_rows, out_features, dtype=dtype)
        else:
            if self.buffer is None or result_offset is None or not isinstance(source, m.ShmPayload):
                raise InvalidInput("a shared-memory call needs an attached buffer and a result offset")
            rows = self.buffer.tensor(source.offset, dtype, (num_rows, in_features))
            result = self.buffer.tensor(result_offset, dtype, (num_rows, out_features))
            if source.offset < result_offset + result.nbytes and result_offset < source.offset + rows.nbytes:
                raise InvalidInput("a call's rows and result overlap in the buffer")
        work = LoraWork(adapter_id=key, layer=call.layer, projection=call.projection,
                        expert_counts=call.expert_counts, rows=rows, result=result)
        try:
            await self.server.submit(work, self.peer)
        except (LorafaasError, asyncio.CancelledError):
            raise
        except Exception as exc:
            raise ServerError(f"computing the deltas of adapter {call.adapter_id} failed: {exc}") from exc
        payload: m.Payload = m.ShmPayload(offset=result_offset) if result_offset is not None and data is None \
            else m.InlinePayload(nbytes=result.nbytes)
        frame = encode_frame(m.LoraResult(seq=call.seq, num_rows=num_rows, out_features=out_features, result=payload))
        if data is not None:  # the deltas follow the frame
            await self.conn.send(frame, memoryview(result.view(torch.uint8).numpy().data).cast("B"))
        else:
            await self.conn.send(frame)

    def _check_shape(self, call: m.LoraCall) -> tuple[int, int, int]:
        """(rows, in, out) of a call, checked before anything else is read or looked up."""
        layout, dtype = self.server.layout, self.server.config.dtype
        if call.dtype != dtype:
            raise InvalidInput(f"rows are {call.dtype}; this LoRA server computes in {dtype}")
        counts = call.expert_counts
        if len(counts) != layout.num_experts or any(c < 0 for c in counts):
            shown = counts if len(counts) <= 16 else f"{len(counts)} counts"
            raise InvalidInput(f"expert_counts must be {layout.num_experts} non-negative counts, got {shown}")
        num_rows = sum(counts)
        if not 0 < num_rows <= MAX_ROWS_PER_CALL:
            raise InvalidInput(f"a call carries {num_rows} rows; it must carry 1 to {MAX_ROWS_PER_CALL}")
        in_features, out_features = layout.features(call.projection)
        nbytes = num_rows * (in_features + out_features) * TORCH_DTYPES[dtype].itemsize
        if nbytes > MAX_CALL_BYTES:
            raise InvalidInput(f"a call's rows and deltas are {nbytes} bytes; at most {MAX_CALL_BYTES}")
        return num_rows, in_features, out_features
