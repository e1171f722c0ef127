"""A CPU device's step gate: its workers ask before each engine step and are granted cores (`CoreGrants`), so no
more instances compute at once than the device has cores for, counted across functions.

One Unix socket per device, owner-only. A connection is accepted only from a live worker of this agent (the kernel
names the peer's pid, `SO_PEERCRED`), one per worker: a worker cannot hold more than one step's cores, and a process
that is no worker of ours cannot take any. A worker that dies or hangs up gives its cores back. A worker may say it is
a member of the device's shared base pass (`CoreGrants.join`); only a worker the agent started in it
(`is_member`) is heard. Each ask and each step's end first tell the policy the host's load besides our steps
(`HostLoad`, read at most every half second). Protocol: `lorafaas.function_runtime.step_gate`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

from lorafaas.platform.host_load import HostLoad
from lorafaas.protocols.leases import socket_peer_pid
from lorafaas.protocols.socket_path import BoundPath
from lorafaas.protocols.step_gate import DONE, DONE_UNSAMPLED, LEAVE, MEMBER, NEXT, NEXT_UNSAMPLED, SHARED, WANT
from lorafaas.scheduler import SHARED_PASS, CoreGrants

log = logging.getLogger(__name__)


class ComputeGate:
    def __init__(self, path: Path, grants: CoreGrants[int], is_worker: Callable[[int], bool],
                 is_member: Callable[[int], bool] = lambda pid: False, host_load: HostLoad | None = None) -> None:
        self.path = path
        self.grants = grants
        self.is_worker = is_worker  # pid -> whether it is a live worker of this agent
        self.is_member = is_member  # pid -> whether the agent started it in the shared base pass
        self.host_load = host_load or HostLoad()
        self._writers: dict[int, asyncio.StreamWriter] = {}  # pid -> its connection
        self._server: asyncio.AbstractServer | None = None
        self._expiry: asyncio.Task | None = None
        self._bound: BoundPath | None = None

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        self._bound = BoundPath(self.path)  # mode 0600; removed at stop only while still this gate's
        if math.isfinite(self.grants.lease_s):
            self._expiry = asyncio.create_task(self._expire_forever())

    async def stop(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers.values()):
                writer.close()
            self._server = None
        if self._bound is not None:  # a successor's socket at the same path is left alone
            self._bound.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pid = socket_peer_pid(writer.get_extra_info("socket"))
        if pid is None or pid in self._writers or not self.is_worker(pid):
            log.warning("step gate: refused a connection from pid %s (not a worker of this agent, or its second)", pid)
            writer.close()
            return
        self._writers[pid] = writer
        try:
            while byte := await reader.read(1):
                self._sample_host_load()
                if byte == WANT:
                    self._send(self.grants.want(pid, time.monotonic()))
                elif byte in (DONE, NEXT, DONE_UNSAMPLED, NEXT_UNSAMPLED):
                    self._send(self.grants.done(pid, again=byte in (NEXT, NEXT_UNSAMPLED), now_s=time.monotonic(),
                                                sample=byte in (DONE, NEXT)))
                elif byte == MEMBER and self.is_member(pid):
                    self.grants.join(pid)
                elif byte == LEAVE:
                    self._send(self.grants.leave(pid, time.monotonic()))
                elif byte == MEMBER:  # shared grants to a process outside the pass would take cores unaccounted
                    log.warning("step gate: pid %d says it is in the shared base pass, and is not; hanging up", pid)
                    break
                else:
                    log.warning("step gate: pid %d sent %r; hanging up", pid, byte)
                    break
        except ConnectionError:
            pass
        finally:
            del self._writers[pid]
            writer.close()
            self._send(self.grants.gone(pid, time.monotonic()))

    def _sample_host_load(self) -> None:
        grants = self.grants
        # ours: this process, the grants' threads, and while members share, the executor on every core
        ours = 1 + grants.cores - grants.free + (grants.cores + grants.in_pass if grants.in_pass else 0)
        others = self.host_load.sample(ours, time.monotonic())
        if others is not None:
            grants.host_load(others)

    async def _expire_forever(self) -> None:
        """A worker stuck in its step loses its grant after the lease (`CoreGrants.expire`)."""
        while True:
            await asyncio.sleep(self.grants.lease_s / 4)
            self._send(self.grants.expire(time.monotonic()))

    def _send(self, grants: list[tuple[int, int]]) -> None:
        for pid, threads in grants:
            writer = self._writers.get(pid)
            if writer is None or writer.is_closing():
                self._send(self.grants.gone(pid, time.monotonic()))
                continue
            writer.write(bytes([SHARED | self.grants.base_threads if threads == SHARED_PASS else threads]))
