"""Moving a call's rows and deltas between a function instance and the LoRA server: shared memory or TCP.

On one node (address: a Unix socket path) the client owns a duplex shared-memory buffer (a sealed memfd whose
descriptor it sends over the socket) that the server maps too;
a call writes the routed rows into it and sends one small frame (the notification); the server computes straight from
the buffer and writes the deltas into it, then answers with one frame. No tensor is serialized: one memcpy in, the
deltas read in place. Between nodes (address: `tcp://host:port`) the same messages travel over TCP and the tensors
follow their frame as raw bytes.

    client = LoraServerClient.connect("/run/lora.sock", client="fn-a/0")
    client.register(adapter_id, adapter_dir)
    pending = client.start_call(adapter_id, layer, "gate_up_proj", rows, expert_counts)   # returns at once
    ... base expert GEMMs ...
    delta = pending.wait()                                                                  # valid until next call
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import socket
from pathlib import Path
from typing import TypeVar, cast

import msgspec
import torch

from lorafaas.errors import DaemonUnavailable, InvalidInput, ProtocolError, SegmentError
from lorafaas.protocols import lora_server_messages as m
from lorafaas.wire import encode_frame, error_class, recv_message

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_BUFFER_BYTES = 1 << 20
BUFFER_PREFIX = "lorafaas-lora."  # the memfd's name (in /proc/PID/fd links only: a memfd is in no directory)
BUFFER_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
MAX_BUFFER_BYTES = 1 << 31  # the largest buffer the server maps
ALIGNMENT = 64
TORCH_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES: dict[torch.dtype, m.DType] = {v: cast(m.DType, k) for k, v in TORCH_DTYPES.items()}  # (m.DType's names)


def align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


class DuplexBuffer:
    """A memfd both sides map read-write: the client writes rows, the server writes deltas. It has no name: the client
    hands its descriptor to the server over the Unix socket (SCM_RIGHTS), so no other process can open it, and it is
    sealed against shrinking and growing, so its size cannot change under the server's mapping (a shrink would fault
    the server, SIGBUS, and every function's calls with it)."""

    def __init__(self, size: int) -> None:
        self.fd: int | None = os.memfd_create(f"{BUFFER_PREFIX}{os.getpid()}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, BUFFER_SEALS)
            self._mmap: mmap.mmap | None = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(self.fd)
            raise SegmentError(f"cannot make a {size}-byte LoRA buffer: {exc}") from exc
        self.size = size
        self._bytes: torch.Tensor | None = torch.frombuffer(self._mmap, dtype=torch.uint8)

    @classmethod
    def create(cls, size: int) -> DuplexBuffer:
        return cls(align(size))

    def tensor(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A view of the buffer; raises SegmentError if it does not fit."""
        if self._bytes is None:
            raise SegmentError("the LoRA buffer is closed")
        return buffer_view(self._bytes, self.size, offset, dtype, shape)

    def write(self, offset: int, tensor: torch.Tensor) -> None:
        """Copy a tensor's bytes in with one plain memcpy (torch's copy_ may wake its thread pool for this)."""
        data = tensor.contiguous().view(torch.uint8).numpy().data.cast("B")
        if offset < 0 or offset % ALIGNMENT or offset + data.nbytes > self.size:
            raise SegmentError(f"{data.nbytes} bytes at offset {offset} do not fit the {self.size}-byte LoRA buffer")
        if self._mmap is None:
            raise SegmentError("the LoRA buffer is closed")
        self._mmap[offset : offset + data.nbytes] = data

    def close_fd(self) -> None:
        """The descriptor is needed only until the server has its own (the mapping stays)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        self.close_fd()
        self._bytes = None
        if self._mmap is not None:
            with contextlib.suppress(BufferError):  # a caller still holds a view: the mapping goes with it
                self._mmap.close()
            self._mmap = None


def buffer_view(flat: torch.Tensor, size: int, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """`shape` elements of `dtype` at byte `offset` of a byte tensor of `size` bytes; SegmentError if they do not
    fit."""
    nbytes = dtype.itemsize * int(torch.Size(shape).numel())
    if offset < 0 or offset % ALIGNMENT or offset + nbytes > size:
        raise SegmentError(
            f"{nbytes} bytes at offset {offset} do not fit the {size}-byte LoRA buffer "
            f"(offsets are multiples of {ALIGNMENT})"
        )
    return flat[offset : offset + nbytes].view(dtype).view(shape)


class PendingCall:
    """A call in flight; `wait` returns its deltas."""

    def __init__(self, client: LoraServerClient, seq: int, dtype: torch.dtype, result: torch.Tensor | None) -> None:
        self._client = client
        self.seq = seq
        self.dtype = dtype
        self._result = result  # shm: the buffer view the server fills

    def wait(self) -> torch.Tensor:
        return self._client._finish(self)


class LoraServerClient:
    """The one wrapper a function instance uses to reach a LoRA server (blocking socket, one call in flight)."""

    def __init__(self, sock: socket.socket, address: str, transport: str) -> None:
        self._sock = sock
        self.address = address
        self.transport = transport  # "shm" | "tcp"
        self._welcome: m.Welcome | None = None  # set by connect
        self._buffer: DuplexBuffer | None = None
        self._seq = 0
        self._in_flight: PendingCall | None = None

    @classmethod
    def connect(
        cls,
        address: str,
        *,
        client: str = "",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    ) -> LoraServerClient:
        """`address`: a Unix socket path (shared-memory transport) or `tcp://host:port`."""
        target: tuple[str, int] | str
        if address.startswith("tcp://"):
            host, _, port = address.removeprefix("tcp://").rpartition(":")
            if not host or not port.isdigit():
                raise InvalidInput(f"LoRA server address {address!r} is not tcp://HOST:PORT")
            sock, target, transport = socket.socket(socket.AF_INET, socket.SOCK_STREAM), (host, int(port)), "tcp"
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small frames: no Nagle delay
        else:
            sock, target, transport = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), str(Path(address)), "shm"
        sock.settimeout(timeout_s)
        try:
            sock.connect(target)
        except OSError as exc:
            sock.close()
            raise DaemonUnavailable(f"no LoRA server is listening at {address} ({exc})") from exc
        self = cls(sock, address, transport)
        try:
            self._welcome = self._call(m.Hello(protocol_version=m.PROTOCOL_VERSION, client=client), m.Welcome)
            if transport == "shm":
                self._attach_buffer(buffer_bytes)
        except BaseException:
            self.close()
            raise
        return self

    @property
    def welcome(self) -> m.Welcome:
        """The server's answer to our Hello (every client `connect` returns has one)."""
        if self._welcome is None:
            raise ProtocolError("the LoRA server has not welcomed this client")
        return self._welcome

    def __enter__(self) -> LoraServerClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None

    def register(self, adapter_id: str, adapter_dir: str) -> m.AdapterRegistered:
        """Register an adapter under this connection's `adapter_id`. On the Unix socket the server reads it through a
        descriptor of `adapter_dir` opened here (so it reads nothing this process could not), over TCP by path."""
        request = m.RegisterAdapter(adapter_id=adapter_id, adapter_dir=str(adapter_dir))
        if self.transport == "tcp":
            return self._call(request, m.AdapterRegistered)
        try:
            fd = os.open(adapter_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise InvalidInput(f"cannot open the adapter directory {adapter_dir}: {exc.strerror}") from exc
        try:
            return self._call(request, m.AdapterRegistered, fds=[fd])
        finally:
            os.close(fd)

    def status(self) -> m.ServerStatus:
        return self._call(m.Status(), m.ServerStatus)

    def shutdown(self, token: str) -> m.ShuttingDown:
        """Stop the server; `token` is the one in its ready line (`spawn_lora_server`'s addresses)."""
        return self._call(m.Shutdown(token=token), m.ShuttingDown)

    # -- calls ---------------------------------------------------------------------------------------------------

    def start_call(
        self, adapter_id: str, layer: int, projection: str, rows: torch.Tensor, expert_counts: list[int]
    ) -> PendingCall:
        """Push one projection's routed rows (sorted by expert) to the server; returns before the deltas exist."""
        if self._in_flight is not None:
            raise ProtocolError("a LoRA call is already in flight on this connection; wait for it first")
        dtype = DTYPE_NAMES.get(rows.dtype)
        if dtype is None:
            raise InvalidInput(f"rows of dtype {rows.dtype} cannot be sent; use one of {', '.join(TORCH_DTYPES)}")
        welcome = self.welcome
        out_features = 2 * welcome.intermediate_size if projection == "gate_up_proj" else welcome.hidden_size
        num_rows = rows.shape[0]
        self._seq += 1
        # Sent as given: the server validates the projection (and answers an error for an unknown one).
        projection_name = cast(m.Projection, projection)

        def call(rows_payload: m.Payload, result_offset: int | None = None) -> m.LoraCall:
            return m.LoraCall(seq=self._seq, adapter_id=adapter_id, layer=layer, projection=projection_name,
                              dtype=dtype, expert_counts=tuple(expert_counts), rows=rows_payload,
                              result_offset=result_offset)

        result: torch.Tensor | None
        try:
            if self.transport == "shm":
                rows_bytes = align(rows.nbytes)
                needed = rows_bytes + num_rows * out_features * rows.dtype.itemsize
                buffer = self._shared_buffer()
                if needed > buffer.size:
                    self._grow_buffer(needed)
                    buffer = self._shared_buffer()
                buffer.write(0, rows)
                result = buffer.tensor(rows_bytes, rows.dtype, (num_rows, out_features))
                self._sock.sendall(encode_frame(call(m.ShmPayload(offset=0), rows_bytes)))
            else:
                result = None
                payload = rows.contiguous().view(torch.uint8).numpy()
                self._sock.sendall(encode_frame(call(m.InlinePayload(nbytes=payload.nbytes))))
                self._sock.sendall(payload.data.cast("B"))
        except OSError as exc:
            raise DaemonUnavailable(f"the LoRA server at {self.address} stopped answering: {exc}") from exc
        self._in_flight = PendingCall(self, self._seq, rows.dtype, result)
        return self._in_flight

    def _finish(self, pending: PendingCall) -> torch.Tensor:
        if self._in_flight is not pending:
            raise ProtocolError(f"LoRA call {pending.seq} is not the one in flight")
        self._in_flight = None
        reply = self._receive(m.LoraResult)
        if reply.seq != pending.seq:
            raise ProtocolError(f"the LoRA server answered call {reply.seq}, expected {pending.seq}")
        if isinstance(reply.result, m.ShmPayload):
            if pending._result is None:
                raise ProtocolError(f"the LoRA server answered call {reply.seq} in shared memory; it was sent inline")
            return pending._result
        expected_bytes = reply.num_rows * reply.out_features * pending.dtype.itemsize
        if reply.result.nbytes != expected_bytes:
            raise ProtocolError(f"LoRA server sent {reply.result.nbytes} bytes of deltas; expected {expected_bytes}")
        data = self._recv_exactly(expected_bytes)
        return torch.frombuffer(data, dtype=pending.dtype).view(reply.num_rows, reply.out_features)

    # -- plumbing ------------------------------------------------------------------------------------------------

    def _attach_buffer(self, size: int) -> None:
        buffer = DuplexBuffer.create(size)
        try:
            assert buffer.fd is not None  # a new buffer holds its descriptor until close_fd
            self._call(m.AttachBuffer(size=buffer.size), m.BufferAttached, fds=[buffer.fd])
        except BaseException:
            buffer.close()
            raise
        buffer.close_fd()  # the server has its own descriptor (or mapping) now
        if self._buffer is not None:
            self._buffer.close()
        self._buffer = buffer

    def _grow_buffer(self, needed: int) -> None:
        self._attach_buffer(max(needed, min(2 * self._shared_buffer().size, MAX_BUFFER_BYTES)))

    def _shared_buffer(self) -> DuplexBuffer:
        if self._buffer is None:  # connect attaches one on the shm transport; close detaches it
            raise ProtocolError(f"no LoRA buffer is attached to the connection to {self.address}")
        return self._buffer

    def _call(self, request: m.Request, expected: type[T], fds: list[int] | None = None) -> T:
        try:
            data = encode_frame(request)
            if fds:
                sent = socket.send_fds(self._sock, [data], fds)  # the descriptors ride on the frame's first byte
                self._sock.sendall(data[sent:])
            else:
                self._sock.sendall(data)
        except OSError as exc:
            raise DaemonUnavailable(f"the LoRA server at {self.address} stopped answering: {exc}") from exc
        return self._receive(expected)

    def _receive(self, expected: type[T]) -> T:
        try:
            response = recv_message(self._sock, m.response_decoder)
        except OSError as exc:
            raise DaemonUnavailable(f"the LoRA server at {self.address} stopped answering: {exc}") from exc
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            raise ProtocolError(f"the LoRA server at {self.address} sent a malformed reply: {exc}") from exc
        if isinstance(response, m.ErrorReply):
            raise error_class(response.code)(response.message)
        if not isinstance(response, expected):
            raise ProtocolError(f"expected {expected.__name__} from the LoRA server, got {type(response).__name__}")
        return response

    def _recv_exactly(self, n: int) -> bytearray:
        data = bytearray(n)
        view, done = memoryview(data), 0
        try:
            while done < n:
                got = self._sock.recv_into(view[done:])
                if not got:
                    raise ConnectionError("the peer closed the connection")
                done += got
        except OSError as exc:
            raise DaemonUnavailable(f"the LoRA server at {self.address} stopped answering: {exc}") from exc
        return data
