"""The device's base-pass executor: one thread of the backbone daemon computing the backbone's shared linear layers
for the rows of every function instance at the same point of its forward pass (protocol:
`lorafaas.protocols.base_pass`).

Passes are gathered in rounds, as the round policy decides (`lorafaas.backbone_daemon.round_policy`: who is in a
round, pass order, stragglers, each member's budget for calls computed alone, evictions); this module applies its
decisions: it computes, answers DONE or ALONE, and hangs up. A member's first group (key 0) is a pass start: two or
more starters begin a round together and one alone is told ALONE (it computes that pass itself, from its own
read-only mapping of the backbone). Within a round the executor waits, group by group, for each round member's
call, and computes the calls together.

The products are `GroupWeights`' (`lorafaas.backbone_daemon.group_weights`: each group's tensors, resolved in the
segment, and on a bf16 backbone a packed copy of them made when the first member joins and dropped when the last
leaves, computed on one thread).

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
descriptor (`lorafaas.backbone_daemon.base_pass_member`), and the executor writes each member's output rows into that
member's buffer only. Requests are checked (group index, rows, buffer size, pass order); whatever fails while
admitting or reading one member refuses or hangs up on that member alone (docs/sharing.md, "Threat model").
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import msgspec
import torch
import torch.nn.functional as F

from lorafaas.backbone_daemon.base_pass_member import Member, admit
from lorafaas.backbone_daemon.group_weights import GroupWeights, packs_bf16
from lorafaas.backbone_daemon.round_policy import BasePassStats, Evict, RoundConfig, RoundPolicy, TellAlone
from lorafaas.protocols import base_pass as bp
from lorafaas.protocols.leases import socket_peer_pid

log = logging.getLogger(__name__)
_hello_decoder = msgspec.msgpack.Decoder(bp.BasePassHello)
STATS_LOG_INTERVAL_S = 10.0


def executor_threads(weights: GroupWeights, threads: int | None) -> int | None:
    """The threads the executor computes `weights`' products on: one from packed bf16 weights, else `threads`."""
    return 1 if weights.packed else threads


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
        self.policy = RoundPolicy(0, 0, RoundConfig(hold_s=hold_s, deadline_s=deadline_s,
                                                    penalty_passes=penalty_passes, **(round_config or {})))
        self.stats: BasePassStats = self.policy.stats
        # the backbone's groups (every member's hello must name exactly these), their tensors and products
        self.weights = GroupWeights(tensors, tuple(groups), linear)
        self.policy.num_groups, self.policy.first_tail = self.weights.num_groups, self.weights.first_tail
        self._members: dict[socket.socket, Member] = {}
        self._by_id: dict[int, Member] = {}
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

    def _read_guarded(self, member: Member) -> None:
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
        member = Member(sock=sock, pid=pid)
        self._members[sock] = member
        self._selector.register(sock, selectors.EVENT_READ)

    def _read(self, member: Member) -> None:
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
            num_groups = self.weights.num_groups
            skip = rows == 0 and flags == 0 and 0 <= key < num_groups and self.weights.is_gated_mlp(key)
            # FUSED only starts a pass (key 0), and only where the backbone has tails
            bad_fused = flags & bp.FUSED and (key != 0 or not self.weights.has_tails)
            if not 0 <= key < num_groups or not (skip or 0 < rows <= member.max_rows) or bad_fused:
                self._drop(member, f"bad call (group {key}, {rows} rows)")
                return
            self.policy.receive(member.id, key, rows, flags, time.monotonic())  # its order: the policy's

    def _greet(self, member: Member) -> None:
        try:
            payload = member.take_frame()
        except ValueError as exc:
            self._drop(member, str(exc))
            return
        if payload is None:
            return
        try:
            admit(member, _hello_decoder.decode(payload), self.weights)
            if not self.packed:  # once a hello is accepted: a refused one costs no copy
                self._pack_if_bf16()
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
        member.reply_frame(bp.BasePassWelcome(accepted=True))

    @property
    def packed(self) -> bool:
        """The current model's products come from a packed copy of its weights (`GroupWeights.pack_if_bf16`)."""
        return self.weights.packed

    def _pack_if_bf16(self) -> None:
        """On a bf16 backbone, compute from a packed copy of its weights, on one thread (`group_weights`)."""
        if self.pack_bf16 and self.weights.pack_if_bf16():
            # on the executor's thread: it reads the hellos
            torch.set_num_threads(executor_threads(self.weights, self.threads) or 1)

    def _refuse(self, member: Member, why: str) -> None:
        self.stats.refused += 1
        self.policy.refused(member.pid, time.monotonic())  # its next connections are closed at accept, for a while
        log.warning("base pass: refused pid %d: %s", member.pid, why)
        member.reply_frame(bp.BasePassWelcome(accepted=False, message=why))
        self._drop(member, None)

    def _drop(self, member: Member, why: str | None) -> None:
        if why:
            log.warning("base pass: hanging up on pid %d: %s", member.pid, why)
        self._members.pop(member.sock, None)
        if self._by_id.pop(member.id, None) is not None:
            self.policy.leave(member.id)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(member.sock)
        member.close()
        if not self._members and self.packed:  # the packed copy lives while members do
            self.weights.unpack()
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

    def _compute(self, members: list[Member], rows_of: list[int], key: int) -> None:
        """Group `key`'s outputs for each member's rows, written into that member's buffer only."""
        started = time.monotonic()
        width = self.weights.in_width(key)
        computing = [(m, rows) for m, rows in zip(members, rows_of, strict=True) if rows > 0]
        if computing:
            inputs = [m.mapped()[: rows * width].view(rows, width) for m, rows in computing]
            x = inputs[0] if len(inputs) == 1 else torch.cat(inputs)
            outputs = self.weights.compute(key, x)
            if len(computing) > 1:
                self.stats.batched_products += self.weights.num_products(key)
            row = 0
            for member, rows in computing:
                offset = member.output_offset
                for out in outputs:
                    size = rows * out.shape[1]
                    member.mapped()[offset:offset + size].view(rows, out.shape[1]).copy_(out[row:row + rows])
                    offset += size
                row += rows
        self.stats.compute_s += time.monotonic() - started

    def _send(self, member: Member, reply: bytes) -> None:
        try:
            member.sock.send(reply)
        except OSError as exc:  # it stopped reading (its socket buffer is full) or went away
            self._drop(member, str(exc))
