"""The device's base-pass executor: one thread of the backbone daemon computing the backbone's shared linear layers
for the rows of every function instance at the same point of its forward pass (protocol:
`lorafaas.protocols.base_pass`).

Passes are gathered in rounds, as the round policy decides (`lorafaas.backbone_daemon.round_policy`: who is in a
round, pass order, stragglers, each member's budget for calls computed alone, evictions); this module applies its
decisions: it computes, answers DONE or ALONE, and hangs up. A member's first group (key 0) is a pass start: two or
more starters begin a round together and one alone is told ALONE (it computes that pass itself, from its own
read-only mapping of the backbone). Within a round the executor waits, group by group, for each round member's
call, and computes the calls together.

Products on a bf16 backbone, where oneDNN computes bf16 natively (AVX-512 BF16), go from a private copy of the
weights in oneDNN's own blocked layout, made when the first member joins and dropped when the last leaves, on one
thread: 32 ms a SmolLM2 pass at eight rows against 48 ms from the segment's plain layout on one thread and 46 ms on
two (docs/performance.md, "Packed bf16 weights"). The outputs are the same bit for bit.

A gated MLP group (`GroupSpec.mlp_down`) is computed whole, as the Llama family does: down(silu(gate(x)) * up(x)).
Its call may carry 0 rows: that member computes the MLP itself (its adapter wraps one of the layers) and only keeps
its place in the round.

A round is fused when its starters' first calls say FUSED: after key 0 it goes through the layer tails
(`GroupSpec.tail`: a layer's o_proj, MLP, residual adds and the next norm and products, as the model family computes
them: `lorafaas.models.families.llama`), one call a decoder layer. Starters of the two kinds at once: the more
numerous kind forms the round, the others are told ALONE.

Isolation: a connection is accepted only from a process holding a lease on this daemon's backbone (the kernel names
the peer's pid, `SO_PEERCRED`) and not evicted lately; the layer groups are the backbone's, given by the daemon, and
a hello must name exactly them; each member's rows live in its own buffer, mapped here without keeping its
descriptor (`lorafaas.protocols.shared_mapping`), and the executor writes each member's output rows into that
member's buffer only. Requests are checked (group index, rows, buffer size, pass order); whatever fails while
admitting or reading one member refuses or hangs up on that member alone (docs/sharing.md, "Threat model").
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import fcntl
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import msgspec
import torch
import torch.nn.functional as F

from lorafaas.backbone_daemon.round_policy import BasePassStats, Evict, RoundConfig, RoundPolicy, TellAlone
from lorafaas.models.families.llama import gated_mlp, layer_tail, rms_norm
from lorafaas.protocols import base_pass as bp
from lorafaas.protocols.leases import socket_peer_pid
from lorafaas.protocols.shared_mapping import map_shared
from lorafaas.wire import FRAME_HEADER_BYTES, encode_frame, frame_length

log = logging.getLogger(__name__)
_hello_decoder = msgspec.msgpack.Decoder(bp.BasePassHello)
STATS_LOG_INTERVAL_S = 10.0
F_SEAL_FUTURE_WRITE = 0x0010  # linux/fcntl.h (Python's fcntl names it from 3.14 only)
PACK_BATCH_HINT = 8  # rows a round usually has (eight one-row functions): oneDNN picks its blocking for it


def packs_bf16() -> bool:
    """Whether oneDNN computes bf16 products natively on this CPU (else a packed copy would only cost memory)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a weight packed by `torch.ops.mkldnn._reorder_linear_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@dataclass(frozen=True)
class _Tail:
    """A layer tail's tensors (`bp.LayerTail`), resolved in the segment."""

    o_proj: torch.Tensor
    post_norm: torch.Tensor
    mlp: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # gate, up, down
    next_norm: torch.Tensor
    eps: float


@dataclass
class _Member:
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


class BasePassExecutor:
    def __init__(self, path: Path, tensors: dict[str, torch.Tensor], groups: tuple[bp.GroupSpec, ...],
                 may_join: Callable[[int], bool], *,
                 threads: int | None = None, hold_s: float = 0.05, deadline_s: float = 0.05,
                 penalty_passes: int = 10, round_config: dict | None = None, pack_bf16: bool = True,
                 linear: Callable[..., torch.Tensor] = F.linear) -> None:
        """`groups`: the backbone's, as the daemon derives them from it (`lorafaas.models.base_pass_groups`); every
        hello must name exactly these. `linear`: the kernel of the products from the segment's weights (the daemon's
        float32 choice, lorafaas/models/cpu_linear.py); packed bf16 weights have their own. Raises ValueError if
        the groups do not fit the tensors."""
        self.path = Path(path)
        self.tensors = tensors
        self.may_join = may_join
        self.threads = threads
        self.hold_s = hold_s
        self.deadline_s = deadline_s
        self.penalty_passes = penalty_passes
        self.pack_bf16 = pack_bf16 and packs_bf16()
        self.linear = linear
        self._linear: Callable[..., torch.Tensor] = linear
        self.policy = RoundPolicy(0, 0, RoundConfig(hold_s=hold_s, deadline_s=deadline_s,
                                                    penalty_passes=penalty_passes, **(round_config or {})))
        self.stats: BasePassStats = self.policy.stats
        self._groups = tuple(groups)  # the backbone's: every member's hello must name exactly these
        self._layers: list[list[tuple[torch.Tensor, torch.Tensor | None]]] = []
        self._downs: list[torch.Tensor | None] = []  # per group: a gated MLP's down weight, else None
        self._tails: list[_Tail | None] = []  # per group: a layer tail's tensors, else None
        self._first_tail = 0  # the first tail group (len(groups) without tails)
        self._resolve_groups()
        self.policy.num_groups, self.policy.first_tail = len(self._layers), self._first_tail
        self._members: dict[socket.socket, _Member] = {}
        self._by_id: dict[int, _Member] = {}
        self._next_id = 1
        self._selector = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread: threading.Thread | None = None
        self._stopping = False

    # -- life ---------------------------------------------------------------------------------------------------

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.path))
        self.path.chmod(0o600)
        listener.listen(64)
        listener.setblocking(False)
        self._listener = listener
        self._selector.register(listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="base-pass", daemon=True)
        self._thread.start()
        log.info("base pass: serving on %s", self.path)

    def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(timeout=5)
        log.info("base pass: stopped with %d member(s); %s", len(self._members), self.stats)
        for member in list(self._members.values()):
            self._drop(member, None)
        if self._listener is not None:
            self._listener.close()
        self.path.unlink(missing_ok=True)
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    def _run(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)  # per OS thread: this one computes every product
        logged, logged_s = dataclasses.replace(self.stats), time.monotonic()
        while not self._stopping:
            now = time.monotonic()
            if now - logged_s >= STATS_LOG_INTERVAL_S and self.stats != logged:
                log.info("base pass: %d member(s); %s", len(self._members), self.stats)
                logged, logged_s = dataclasses.replace(self.stats), now
            timeout = self._timeout(now)
            timeout = STATS_LOG_INTERVAL_S if timeout is None else min(timeout, STATS_LOG_INTERVAL_S)
            events = self._selector.select(timeout)
            for key, _ in events:
                if key.fileobj is self._listener:
                    self._accept()
                elif key.fileobj is self._wake_r:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(64)
                else:
                    # every other registered file is a member's socket
                    member = self._members.get(cast(socket.socket, key.fileobj))
                    if member is not None:
                        self._read_guarded(member)
            try:
                self._advance(time.monotonic())
            except Exception:  # a product failed: the platform's fault, not a member's (calls are checked on receipt)
                log.exception("base pass: a product failed")

    def _read_guarded(self, member: _Member) -> None:
        """Whatever one member's bytes make fail is that member's alone: it is refused (in its hello) or hung up on,
        and no other member's state is touched."""
        try:
            self._read(member)
        except Exception as exc:
            log.exception("base pass: reading pid %d failed", member.pid)
            if member.greeted:
                self._drop(member, f"its message failed: {exc!r}")
            else:
                self._refuse(member, f"its hello failed: {exc!r}")

    def _timeout(self, now: float) -> float | None:
        wakeup = self.policy.next_wakeup(now)
        return None if wakeup is None else max(0.0, wakeup - now)

    # -- connections ----------------------------------------------------------------------------------------------

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()  # type: ignore[union-attr]
        except BlockingIOError:
            return
        pid = socket_peer_pid(sock)
        if pid is not None and not self.policy.admits(pid, time.monotonic()):  # evicted lately: before any cost
            self.stats.refused += 1
            sock.close()
            return
        try:
            allowed = pid is not None and self.may_join(pid)
        except Exception:  # the lease table did not answer: nobody joins unchecked
            log.exception("base pass: could not check pid %s against the leases", pid)
            allowed = False
        if pid is None or not allowed:
            self.stats.refused += 1
            log.warning("base pass: refused pid %s (it holds no lease on this backbone)", pid)
            sock.close()
            return
        sock.setblocking(False)
        member = _Member(sock=sock, pid=pid)
        self._members[sock] = member
        self._selector.register(sock, selectors.EVENT_READ)

    def _read(self, member: _Member) -> None:
        try:
            if member.greeted:
                data = member.sock.recv(65536)
                fds: list[int] = []
            else:
                data, fds, _flags, _addr = socket.recv_fds(member.sock, 65536, 1)
        except BlockingIOError:
            return
        except OSError as exc:
            self._drop(member, str(exc))
            return
        for fd in fds:
            if member.fd is None:
                member.fd = fd
            else:
                os.close(fd)
        if not data:
            self._drop(member, None)
            return
        member.inbox += data
        if not member.greeted:
            self._greet(member)
        while member.greeted and len(member.inbox) >= bp.HEADER.size:
            key, rows, flags = bp.HEADER.unpack_from(member.inbox)
            del member.inbox[: bp.HEADER.size]
            if key == bp.END_KEY:
                self.policy.end(member.id, bool(flags & bp.AGAIN))
                continue
            # 0 rows: a member computing this gated MLP itself keeps its place in the round (protocol)
            skip = rows == 0 and flags == 0 and 0 <= key < len(self._downs) and self._downs[key] is not None
            # FUSED only starts a pass (key 0), and only where the backbone has tails
            bad_fused = flags & bp.FUSED and (key != 0 or self._first_tail == len(self._layers))
            if not 0 <= key < len(self._layers) or not (skip or 0 < rows <= member.max_rows) or bad_fused:
                self._drop(member, f"bad call (group {key}, {rows} rows)")
                return
            self.policy.receive(member.id, key, rows, flags, time.monotonic())  # its order: the policy's

    def _greet(self, member: _Member) -> None:
        if len(member.inbox) < FRAME_HEADER_BYTES:
            return
        try:
            length = frame_length(bytes(member.inbox[:FRAME_HEADER_BYTES]))
        except ValueError as exc:
            self._drop(member, str(exc))
            return
        if len(member.inbox) < FRAME_HEADER_BYTES + length:
            return
        payload = bytes(member.inbox[FRAME_HEADER_BYTES:FRAME_HEADER_BYTES + length])
        del member.inbox[: FRAME_HEADER_BYTES + length]
        try:
            hello = _hello_decoder.decode(payload)
            self._admit(member, hello)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            self._refuse(member, str(exc))
            return
        except Exception as exc:  # any failure of the admit path (mmap, fstat, a seal) refuses this member alone
            self._refuse(member, f"its buffer cannot be used: {exc!r}")
            return
        member.greeted = True
        member.id, self._next_id = self._next_id, self._next_id + 1
        self._by_id[member.id] = member
        self.policy.join(member.id, time.monotonic(), peer=member.pid)
        self._reply_frame(member, bp.BasePassWelcome(accepted=True))

    def _admit(self, member: _Member, hello: bp.BasePassHello) -> None:
        """Map the member's buffer after checking its hello against the backbone; raises ValueError to refuse."""
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
        if hello.groups != self._groups:
            raise ValueError(f"its layer groups ({len(hello.groups)}) are not the backbone's ({len(self._groups)}, "
                             "derived by the daemon): another model, or a forged hello")
        dtype = self._layers[0][0][0].dtype if self._layers else torch.float32
        if str(dtype).removeprefix("torch.") != hello.dtype:
            raise ValueError(f"the backbone's weights are {dtype}, the member said {hello.dtype}")
        max_in = max((self._in_width(key) for key in range(len(self._layers))), default=1)
        max_out = max((self._out_width(key) for key in range(len(self._layers))), default=1)
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
        if not self.packed:  # once a hello is accepted: a refused one costs no copy
            self._pack_if_bf16()

    def _resolve_groups(self) -> None:
        """The backbone's tensors of each group (the plain layout: `_pack_if_bf16` packs them while members are in)."""
        groups = self._groups
        layers = [self._resolve(group) for group in groups]
        downs = [self._resolve_down(group, layer) for group, layer in zip(groups, layers, strict=True)]
        tails = [self._resolve_tail(group, layer) for group, layer in zip(groups, layers, strict=True)]
        first_tail = next((key for key, tail in enumerate(tails) if tail is not None), len(tails))
        if first_tail == 0 or any(tail is None for tail in tails[first_tail:]):
            raise ValueError("layer tails must come after every other group (a pass starts at group 0)")
        self._layers, self._downs, self._tails, self._first_tail = layers, downs, tails, first_tail
        self._linear = self.linear

    @property
    def packed(self) -> bool:
        """The current model's products come from a packed copy of its weights (`_pack_if_bf16`)."""
        return self._linear is packed_linear

    def _pack_if_bf16(self) -> None:
        """On a bf16 backbone, compute from a packed copy of its weights, on one thread (module docstring)."""
        dtype = self._layers[0][0][0].dtype if self._layers else None
        if not self.pack_bf16 or dtype != torch.bfloat16:
            return
        started = time.monotonic()
        packed: dict[int, torch.Tensor] = {}  # by the segment's address: a weight in two groups is packed once

        def pack(weight: torch.Tensor) -> torch.Tensor:
            if weight.data_ptr() not in packed:
                packed[weight.data_ptr()] = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
            return packed[weight.data_ptr()]

        try:
            layers = [[(pack(weight), bias) for weight, bias in layer] for layer in self._layers]
            downs = [None if down is None else pack(down) for down in self._downs]
            tails = [None if tail is None else dataclasses.replace(
                tail, o_proj=pack(tail.o_proj), mlp=(pack(tail.mlp[0]), pack(tail.mlp[1]), pack(tail.mlp[2])))
                for tail in self._tails]
        except RuntimeError as exc:  # oneDNN refused a shape: the plain layout computes the same
            log.warning("base pass: bf16 weights not packed (%s); computing from the segment's layout", exc)
            return
        self._layers, self._downs, self._tails = layers, downs, tails
        self._linear = packed_linear
        torch.set_num_threads(1)  # this is the executor's thread (the hello is read on it)
        size = sum(w.numel() * w.element_size() for w in packed.values())
        log.info("base pass: bf16 weights packed for oneDNN (%.0f MB, %.2f s)", size / 1e6, time.monotonic() - started)

    def _in_width(self, key: int) -> int:
        tail = self._tails[key]
        if tail is not None:  # the attention's output, the residual and the o_proj delta
            return tail.o_proj.shape[1] + 2 * tail.o_proj.shape[0]
        return self._layers[key][0][0].shape[1]

    def _out_width(self, key: int) -> int:
        down, tail = self._downs[key], self._tails[key]
        if down is not None:
            return down.shape[0]
        products = sum(w.shape[0] for w, _ in self._layers[key])
        return products + 2 * tail.o_proj.shape[0] if tail is not None else products

    def _resolve_tail(self, group: bp.GroupSpec,
                      layers: list[tuple[torch.Tensor, torch.Tensor | None]]) -> _Tail | None:
        spec = group.tail
        if spec is None:
            return None
        if group.mlp_down is not None:
            raise ValueError("a group is a gated MLP or a layer tail, not both")

        def tensor(name: str, dim: int) -> torch.Tensor:
            found = self.tensors.get(name)
            if found is None or found.dim() != dim:
                raise ValueError(f"the backbone has no {dim}-D tensor {name!r} for a layer tail")
            return found

        o_proj, gate, up, down = (tensor(n, 2) for n in (spec.o_proj, spec.gate, spec.up, spec.down))
        post_norm, next_norm = tensor(spec.post_norm, 1), tensor(spec.next_norm, 1)
        hidden = o_proj.shape[0]
        if not (post_norm.shape[0] == next_norm.shape[0] == gate.shape[1] == up.shape[1] == down.shape[0] == hidden
                and gate.shape[0] == up.shape[0] == down.shape[1]):
            raise ValueError(f"the layer tail of {spec.o_proj!r} does not fit the backbone's shapes")
        if any(w.shape[1] != hidden for w, _ in layers):
            raise ValueError(f"the products after the layer tail of {spec.o_proj!r} do not take its width")
        if not 0 < spec.eps < 1:
            raise ValueError(f"a layer tail's eps is {spec.eps}")
        return _Tail(o_proj=o_proj, post_norm=post_norm, mlp=(gate, up, down), next_norm=next_norm, eps=spec.eps)

    def _resolve_down(self, group: bp.GroupSpec,
                      layers: list[tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor | None:
        if group.mlp_down is None:
            return None
        down = self.tensors.get(group.mlp_down)
        if len(layers) != 2 or any(bias is not None for _, bias in layers):
            raise ValueError("a gated MLP group takes two weights (gate and up) and no biases")
        if down is None or down.dim() != 2 or down.shape[1] != layers[0][0].shape[0] \
                or layers[1][0].shape[0] != layers[0][0].shape[0]:
            raise ValueError(f"the backbone has no down weight {group.mlp_down!r} fitting its gate and up")
        return down

    def _resolve(self, group: bp.GroupSpec) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        if not group.weights or len(group.weights) != len(group.biases):
            raise ValueError("a group needs its weights and one bias entry per weight")
        layers: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for weight_name, bias_name in zip(group.weights, group.biases, strict=True):
            weight = self.tensors.get(weight_name)
            if weight is None or weight.dim() != 2:
                raise ValueError(f"the backbone has no linear weight {weight_name!r}")
            bias = None
            if bias_name is not None:
                bias = self.tensors.get(bias_name)
                if bias is None or bias.shape != (weight.shape[0],):
                    raise ValueError(f"the backbone has no bias {bias_name!r} for {weight_name!r}")
            if layers and weight.shape[1] != layers[0][0].shape[1]:
                raise ValueError(f"{weight_name!r} takes another input width than its group's first weight")
            layers.append((weight, bias))
        return layers

    def _refuse(self, member: _Member, why: str) -> None:
        self.stats.refused += 1
        log.warning("base pass: refused pid %d: %s", member.pid, why)
        self._reply_frame(member, bp.BasePassWelcome(accepted=False, message=why))
        self._drop(member, None)

    def _reply_frame(self, member: _Member, message: msgspec.Struct) -> None:
        with contextlib.suppress(OSError):
            member.sock.setblocking(True)
            member.sock.settimeout(1.0)
            member.sock.sendall(encode_frame(message))
            member.sock.setblocking(False)

    def _drop(self, member: _Member, why: str | None) -> None:
        if why:
            log.warning("base pass: hanging up on pid %d: %s", member.pid, why)
        self._members.pop(member.sock, None)
        if self._by_id.pop(member.id, None) is not None:
            self.policy.leave(member.id)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(member.sock)
        member.sock.close()
        member.flat = member.buffer = None  # unmapped once the last view of it goes (`map_shared`)
        if member.fd is not None:
            os.close(member.fd)
        if not self._members and self.packed:  # the packed copy lives while members do
            self._resolve_groups()
            if self.threads and threading.current_thread() is self._thread:
                torch.set_num_threads(self.threads)

    # -- rounds ---------------------------------------------------------------------------------------------------

    def _advance(self, now: float) -> None:
        """Apply the policy's decisions until it has none (`round_policy`)."""
        while (action := self.policy.plan(now)) is not None:
            if isinstance(action, Evict):
                self._drop(self._by_id[action.member], action.why)
            elif isinstance(action, TellAlone):
                self._send(self._by_id[action.member], bp.ALONE)
            else:
                started = time.monotonic()
                members = [self._by_id[m] for m in action.members]
                rows = [self.policy.pending(m)[1] for m in action.members]  # type: ignore[index]
                self._compute(members, rows, action.key)
                now = time.monotonic()
                self.policy.computed(action, now - started, now)
                for member in members:
                    self._send(member, bp.DONE)

    def _compute(self, members: list[_Member], rows_of: list[int], key: int) -> None:
        """Group `key`'s outputs for each member's rows, written into that member's buffer only."""
        started = time.monotonic()
        layer, down, tail = self._layers[key], self._downs[key], self._tails[key]
        width = self._in_width(key)
        computing = [(m, rows) for m, rows in zip(members, rows_of, strict=True) if rows > 0]
        if computing:
            inputs = [m.mapped()[: rows * width].view(rows, width) for m, rows in computing]
            x = inputs[0] if len(inputs) == 1 else torch.cat(inputs)
            if tail is not None:
                outputs = self._tail(tail, layer, x)
            elif down is None:
                outputs = [self._linear(x, weight, bias) for weight, bias in layer]
            else:  # the gated MLP, as the Llama family computes it: down(silu(gate(x)) * up(x))
                outputs = [gated_mlp(self._linear, x, layer[0][0], layer[1][0], down)]
            if len(computing) > 1:
                self.stats.batched_products += len(layer) + (down is not None) + 4 * (tail is not None)  # o, MLP
            row = 0
            for member, rows in computing:
                offset = member.output_offset
                for out in outputs:
                    size = rows * out.shape[1]
                    member.mapped()[offset:offset + size].view(rows, out.shape[1]).copy_(out[row:row + rows])
                    offset += size
                row += rows
        self.stats.compute_s += time.monotonic() - started

    def _tail(self, tail: _Tail, layer: list[tuple[torch.Tensor, torch.Tensor | None]],
              x: torch.Tensor) -> list[torch.Tensor]:
        """A layer tail's outputs for X = [attention output, residual, o_proj delta] (`bp.GroupSpec.tail`)."""
        attended_width, hidden_width = tail.o_proj.shape[1], tail.o_proj.shape[0]
        attended, residual, delta = x.split([attended_width, hidden_width, hidden_width], dim=1)
        hidden = layer_tail(self._linear, attended, residual, delta, tail.o_proj, tail.post_norm, tail.eps, tail.mlp)
        normed = rms_norm(tail.next_norm, tail.eps, hidden)
        return [hidden, normed, *(self._linear(normed, weight, bias) for weight, bias in layer)]

    def _send(self, member: _Member, reply: bytes) -> None:
        try:
            member.sock.send(reply)
        except OSError as exc:  # it stopped reading (its socket buffer is full) or went away
            self._drop(member, str(exc))
