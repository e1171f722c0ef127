"""The worker's side of its device's step gate: a grant of cores before every engine step.

The node agent serves the gate on a Unix socket (`lorafaas.platform.compute_gate`; the policy is
`lorafaas.scheduler.core_grants`). One byte each way, so a step costs one round trip:

    worker -> gate   WANT   a step                  gate -> worker   one byte: the threads granted (1..cores),
                     DONE   the step ended                            with SHARED set: in the shared base pass
                     NEXT   the step ended, and the next is wanted (the reply is the next grant)
                     D, N   as DONE, NEXT, for a step the gate should not measure (a prefill in it, or the pass
                            told it ALONE): its time is not a sample of its mode's (`PassChoice`)
                     MEMBER this instance is in the device's shared base pass (once, before its first WANT)
                     LEAVE  it is not any more (its executor went away): cores for its steps from now on

After NEXT the worker reads its grant before anything else; if it has no step to run by then it says DONE at once.
A grant with SHARED set (`lorafaas.scheduler.core_grants`, "the shared base pass") sends this step's backbone
products to the executor and runs the rest on the threads granted; one without it computes the whole pass here.
A gate that cannot be reached (it went away with its agent) leaves the worker computing ungated, as the operating
system shares the cores: slower under contention, never wrong.
"""

from __future__ import annotations

import logging
import socket

import torch

from lorafaas.protocols.step_gate import DONE, DONE_UNSAMPLED, LEAVE, MEMBER, NEXT, NEXT_UNSAMPLED, SHARED, WANT

log = logging.getLogger(__name__)


class StepGate:
    def __init__(self, path: str, member: bool = False) -> None:
        self.path = path
        self.member = member  # said once, on connecting
        self.shared = False  # the last grant was a step in the shared base pass
        self._sock: socket.socket | None = None
        self._pending = False  # a WANT or NEXT whose grant is not read yet
        self._broken = False
        self.threads = 0  # torch's threads are per OS thread: set on the first grant, in the compute thread

    def acquire(self) -> None:
        """Block until this instance may run a step; set torch's threads to the grant."""
        sock = self._connected()
        if sock is None:
            return
        try:
            if not self._pending:
                sock.sendall(WANT)
            self._pending = False
            granted = sock.recv(1)
        except OSError as exc:
            self._fail(exc)
            return
        if not granted:
            self._fail(ConnectionError("the gate closed the connection"))
            return
        self.shared = bool(granted[0] & SHARED)
        threads = granted[0] & ~SHARED
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads

    def declare_member(self) -> None:
        """This instance joined the device's shared base pass: its grants may say SHARED from now on."""
        self._set_member(True)

    def leave_pass(self) -> None:
        """This instance computes every step itself from now on (its base pass broke): no more SHARED grants."""
        self._set_member(False)

    def _set_member(self, member: bool) -> None:
        self.member = member  # a gate not connected yet hears it on connecting
        if self._sock is not None:
            try:
                self._sock.sendall(MEMBER if member else LEAVE)
            except OSError as exc:
                self._fail(exc)

    def release(self, again: bool, sample: bool = True) -> None:
        """The step ended; `again`: the next one is wanted (its grant is read by the next `acquire` or `withdraw`);
        `sample`: its time is a sample of its mode's (no prefill in it, not told ALONE by the pass)."""
        if self._sock is None:
            return
        try:
            if sample:
                self._sock.sendall(NEXT if again else DONE)
            else:
                self._sock.sendall(NEXT_UNSAMPLED if again else DONE_UNSAMPLED)
            self._pending = again
        except OSError as exc:
            self._fail(exc)

    def withdraw(self) -> None:
        """No step to run after all: take the pending grant and give it back."""
        if self._sock is None or not self._pending:
            return
        self.acquire()
        self.release(again=False)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _connected(self) -> socket.socket | None:
        if self._sock is None and not self._broken:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.path)
                if self.member:
                    sock.sendall(MEMBER)
            except OSError as exc:
                sock.close()
                self._fail(exc)
                return None
            self._sock = sock
        return self._sock

    def _fail(self, exc: BaseException) -> None:
        log.warning("step gate %s unusable (%s): computing ungated from now on", self.path, exc)
        self.close()
        self._broken = True
        self._pending = False
        self.shared = False
