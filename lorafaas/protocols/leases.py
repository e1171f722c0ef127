"""The daemon's lease table: who is attached, and reaping the leases of functions that died.

A lease belongs to the process that asked for it (its pid from the socket's SO_PEERCRED, never from the message).
A lease is reaped when that process is gone (no such pid, a zombie, or the pid reused by a process that started
later) or, with a TTL, when it was not renewed in time. Owned by the daemon's event loop only; no locks.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from lorafaas.errors import LeaseNotFound
from lorafaas.protocols.daemon_messages import LeaseInfo, LeaseRecord


def socket_peer_pid(sock: socket.socket) -> int | None:
    """The pid of the process at the other end of a connected Unix socket, as the kernel recorded it at connect
    (`SO_PEERCRED`); None if the socket cannot tell."""
    with contextlib.suppress(OSError, AttributeError):
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return struct.unpack("3i", creds)[0]
    return None


def process_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()  # after the command name, which may contain spaces
    if fields[0] in (b"Z", b"X"):  # zombie or dead: exited, not yet reaped by its parent
        return None
    return int(fields[19])


def process_alive(pid: int, start_ticks: int | None) -> bool:
    if pid <= 0:
        return True  # unknown (another pid namespace): only a TTL can reap it
    now = process_start_ticks(pid)
    return now is not None and (start_ticks is None or now == start_ticks)


@dataclass
class Lease:
    lease_id: str
    function: str
    pid: int
    start_ticks: int | None
    attached_at: float  # unix time
    renewed_at_s: float  # monotonic


class LeaseTable:
    def __init__(
        self,
        ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        is_alive: Callable[[int, int | None], bool] = process_alive,
    ) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._is_alive = is_alive
        self._leases: dict[str, Lease] = {}
        self.num_reaped = 0

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, function: str, pid: int) -> Lease:
        lease = Lease(
            lease_id=secrets.token_hex(8),
            function=function,
            pid=pid,
            start_ticks=process_start_ticks(pid) if pid > 0 else None,
            attached_at=time.time(),
            renewed_at_s=self._clock(),
        )
        self._leases[lease.lease_id] = lease
        return lease

    def renew(self, lease_id: str) -> Lease:
        lease = self._get(lease_id)
        lease.renewed_at_s = self._clock()
        return lease

    def release(self, lease_id: str) -> Lease:
        lease = self._get(lease_id)
        del self._leases[lease_id]
        return lease

    def reap(self) -> list[tuple[Lease, str]]:
        """Remove and return the leases of dead processes and, with a TTL, of silent ones, each with the reason."""
        now = self._clock()
        reaped = []
        for lease in list(self._leases.values()):
            if not self._is_alive(lease.pid, lease.start_ticks):
                reason = f"process {lease.pid} exited"
            elif self.ttl_s is not None and now - lease.renewed_at_s > self.ttl_s:
                reason = f"no heartbeat for {now - lease.renewed_at_s:.1f} s (TTL {self.ttl_s} s)"
            else:
                continue
            del self._leases[lease.lease_id]
            reaped.append((lease, reason))
        self.num_reaped += len(reaped)
        return reaped

    def records(self) -> tuple[LeaseRecord, ...]:
        """The table as a successor needs it to re-create the leases (see `restore`)."""
        return tuple(
            LeaseRecord(
                lease_id=x.lease_id,
                function=x.function,
                pid=x.pid,
                start_ticks=x.start_ticks,
                attached_at=x.attached_at,
            )
            for x in self._leases.values()
        )

    def restore(self, records: tuple[LeaseRecord, ...]) -> list[Lease]:
        """Re-create a killed predecessor's leases whose processes still live, under the same ids (so their holders
        can renew and detach them here); the others count as reaped. Returns the leases re-created."""
        restored = []
        for record in records:
            if not self._is_alive(record.pid, record.start_ticks):
                self.num_reaped += 1
                continue
            lease = Lease(
                lease_id=record.lease_id,
                function=record.function,
                pid=record.pid,
                start_ticks=record.start_ticks,
                attached_at=record.attached_at,
                renewed_at_s=self._clock(),
            )
            self._leases[lease.lease_id] = lease
            restored.append(lease)
        return restored

    def snapshot(self) -> tuple[LeaseInfo, ...]:
        now = self._clock()
        return tuple(
            LeaseInfo(
                lease_id=x.lease_id,
                function=x.function,
                pid=x.pid,
                attached_at=x.attached_at,
                idle_s=now - x.renewed_at_s,
            )
            for x in self._leases.values()
        )

    def _get(self, lease_id: str) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseNotFound(f"lease {lease_id!r} is not held (released, or reaped after its process died)")
        return lease
