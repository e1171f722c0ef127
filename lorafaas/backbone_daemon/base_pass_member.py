"""A member of the shared base pass as the daemon's executor holds it (`lorafaas.backbone_daemon.base_pass`): its
socket and what it has sent, and its buffer, mapped from the memfd it handed over in its hello; and the admission of
that hello (`admit`): checked against the backbone's groups and the buffer's seals and size, then the buffer mapped
without keeping its descriptor (`lorafaas.protocols.shared_mapping`)."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import socket
from dataclasses import dataclass, field

import msgspec
import torch

from lorafaas.backbone_daemon.group_weights import GroupWeights
from lorafaas.protocols import base_pass as bp
from lorafaas.protocols.shared_mapping import map_shared
from lorafaas.wire import FRAME_HEADER_BYTES, encode_frame, frame_length

F_SEAL_FUTURE_WRITE = 0x0010  # linux/fcntl.h (Python's fcntl names it from 3.14 only)


@dataclass
class Member:
    sock: socket.socket
    pid: int
    inbox: bytearray = field(default_factory=bytearray)
    greeted: bool = False
    fd: int | None = None
    buffer: ctypes.Array | None = None  # the mapping (`map_shared`): no descriptor of the buffer is kept
    flat: torch.Tensor | None = None  # the buffer as elements of the backbone's dtype
    output_offset: int = 0  # in elements
    max_rows: int = 0
    id: int = 0  # its name in the round policy

    def mapped(self) -> torch.Tensor:
        """`flat`, which a member has from its hello until it is dropped."""
        if self.flat is None:
            raise RuntimeError(f"base pass member pid {self.pid} has no buffer mapped")
        return self.flat

    def take_frame(self) -> bytes | None:
        """The payload of the frame at the head of the inbox (its hello), taken out of it; None until it is whole.
        Raises ValueError for a frame length over the limit."""
        if len(self.inbox) < FRAME_HEADER_BYTES:
            return None
        length = frame_length(bytes(self.inbox[:FRAME_HEADER_BYTES]))
        if len(self.inbox) < FRAME_HEADER_BYTES + length:
            return None
        payload = bytes(self.inbox[FRAME_HEADER_BYTES:FRAME_HEADER_BYTES + length])
        del self.inbox[: FRAME_HEADER_BYTES + length]
        return payload

    def reply_frame(self, message: msgspec.Struct) -> None:
        """Send a framed message (its welcome), blocking a second at most; a member that does not read loses it."""
        with contextlib.suppress(OSError):
            self.sock.setblocking(True)
            self.sock.settimeout(1.0)
            self.sock.sendall(encode_frame(message))
            self.sock.setblocking(False)

    def close(self) -> None:
        """Hang up and unmap its buffer (once the last view of it goes: `map_shared`)."""
        self.sock.close()
        self.flat = self.buffer = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def admit(member: Member, hello: bp.BasePassHello, weights: GroupWeights) -> None:
    """Map the member's buffer after checking its hello against the backbone's groups; raises ValueError to
    refuse."""
    if member.fd is None:
        raise ValueError("the hello carried no buffer")
    try:  # a buffer its member could shrink under the mapping would fault this process (SIGBUS), not its own
        sealed = fcntl.fcntl(member.fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
    except OSError:
        sealed = False
    if not sealed:
        raise ValueError("the buffer must be a memfd sealed against shrinking (F_SEAL_SHRINK)")
    if fcntl.fcntl(member.fd, fcntl.F_GET_SEALS) & (fcntl.F_SEAL_WRITE | F_SEAL_FUTURE_WRITE):
        raise ValueError("the buffer is sealed against writes: the executor writes the outputs there")
    if not 1 <= hello.max_rows <= bp.MAX_ROWS:
        raise ValueError(f"max_rows is {hello.max_rows}; it must lie in [1, {bp.MAX_ROWS}]")
    if hello.groups != weights.groups:
        raise ValueError(f"its layer groups ({len(hello.groups)}) are not the backbone's ({len(weights.groups)}, "
                         "derived by the daemon): another model, or a forged hello")
    dtype = weights.dtype or torch.float32
    if str(dtype).removeprefix("torch.") != hello.dtype:
        raise ValueError(f"the backbone's weights are {dtype}, the member said {hello.dtype}")
    max_in = max((weights.in_width(key) for key in range(weights.num_groups)), default=1)
    max_out = max((weights.out_width(key) for key in range(weights.num_groups)), default=1)
    output_offset, size = bp.buffer_layout(hello.max_rows, max_in, max_out, hello.dtype)
    if size > bp.MAX_BUFFER_BYTES or os.fstat(member.fd).st_size < size:
        raise ValueError(f"the buffer must hold {size} bytes (at most {bp.MAX_BUFFER_BYTES})")
    member.buffer = map_shared(member.fd, size)
    with contextlib.suppress(OSError):  # never longer either; and no seal added (F_SEAL_WRITE) from now on
        fcntl.fcntl(member.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    os.close(member.fd)  # the mapping keeps the buffer: no descriptor of it left in /proc/<daemon>/fd
    member.fd = None
    member.flat = torch.frombuffer(member.buffer, dtype=dtype)
    member.output_offset = output_offset // bp.ELEMENT_BYTES[hello.dtype]
    member.max_rows = hello.max_rows
