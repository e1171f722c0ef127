"""What each client of the LoRA server may spend, the same rules as the base pass's round policy
(`lorafaas.backbone_daemon.round_policy`). Pure: no sockets, no torch, no clock of its own (every call takes `now`).

A client is a process on the Unix socket (the kernel's `SO_PEERCRED` pid: its connections share one budget) and a
connection over TCP.

- **Budget.** A batch's compute time is charged to the clients whose calls it carried, in proportion to each call's
  rows x (in + out) width; a client's bucket fills at `share` seconds a second up to `burst_s`. A client whose bucket
  is empty waits (its calls stay queued, the others' go on), so a client looping the largest calls takes at most
  `share` of the compute thread, whoever else is served.
- **Batches.** One client's calls in one batch carry at most `max_rows_per_batch` rows (the rest wait for the next
  batch): a client with many connections does not stretch one batch for everyone.
- **Connections and adapters.** A client holds at most `max_connections` connections and `max_adapters` adapter
  registrations across them (each holds a descriptor of the server's: no client runs the server out of them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

Peer = tuple  # ("pid", pid) | ("tcp", host, port)


@dataclass(frozen=True)
class ClientLimits:
    share: float = 0.25  # of the compute thread's time, per client
    burst_s: float = 0.25
    max_rows_per_batch: int = 1 << 16
    max_connections: int = 32
    max_adapters: int = 64  # registered ids, across the client's connections
    hello_timeout_s: float = 10.0  # from accept to a complete hello
    frame_timeout_s: float = 10.0  # from a frame's first byte to its last
    send_timeout_s: float = 10.0  # for a reply to be taken whole

    def __post_init__(self) -> None:
        if not (0 < self.share <= 1 and self.burst_s > 0 and self.max_rows_per_batch > 0 and self.max_connections > 0
                and self.max_adapters > 0):
            raise ValueError(f"client limits out of range: {self}")
        if min(self.hello_timeout_s, self.frame_timeout_s, self.send_timeout_s) <= 0:
            raise ValueError(f"client timeouts must be positive: {self}")


@dataclass
class _Bucket:
    seconds: float
    at: float
    connections: int = 0
    adapters: int = 0


@dataclass
class ClientPolicy:
    limits: ClientLimits = field(default_factory=ClientLimits)
    num_deferred: int = 0  # calls that waited for their client's budget (counted once each)
    _clients: dict[Peer, _Bucket] = field(default_factory=dict)

    def connect(self, peer: Peer, now: float) -> bool:
        """A new connection of `peer`; False (and not counted) beyond `max_connections`."""
        bucket = self._clients.setdefault(peer, _Bucket(self.limits.burst_s, now))
        if bucket.connections >= self.limits.max_connections:
            return False
        bucket.connections += 1
        return True

    def disconnect(self, peer: Peer) -> None:
        bucket = self._clients.get(peer)
        if bucket is None:
            return
        bucket.connections -= 1
        if bucket.connections <= 0 and bucket.adapters <= 0 and bucket.seconds >= self.limits.burst_s:
            del self._clients[peer]  # nothing owed: forget it (a debt stays until it is paid back)

    def take_adapter(self, peer: Peer, now: float) -> bool:
        """One more registered id for `peer`; False (and not counted) beyond `max_adapters`."""
        bucket = self._bucket(peer, now)
        if bucket.adapters >= self.limits.max_adapters:
            return False
        bucket.adapters += 1
        return True

    def give_adapters(self, peer: Peer, count: int) -> None:
        bucket = self._clients.get(peer)
        if bucket is not None:
            bucket.adapters = max(0, bucket.adapters - count)

    def select(self, calls: list[tuple[Peer, int, bool]], now: float) -> tuple[list[int], list[int]]:
        """The calls (peer, rows, deferred before) to compute in the next batch, by index: those of clients with
        budget left, at most `max_rows_per_batch` rows of each client (its first call always fits); and the calls
        that wait for their client's budget."""
        chosen: list[int] = []
        waiting: list[int] = []
        rows_of: dict[Peer, int] = {}
        for i, (peer, rows, deferred) in enumerate(calls):
            bucket = self._bucket(peer, now)
            if bucket.seconds <= 0:
                self.num_deferred += not deferred
                waiting.append(i)
                continue
            taken = rows_of.get(peer, 0)
            if taken and taken + rows > self.limits.max_rows_per_batch:
                continue
            rows_of[peer] = taken + rows
            chosen.append(i)
        return chosen, waiting

    def charge(self, costs: list[tuple[Peer, float]], seconds: float, now: float) -> None:
        """A batch of calls with these (peer, cost) took `seconds`: each client pays its part."""
        total = sum(cost for _, cost in costs) or 1.0
        for peer, cost in costs:
            self._bucket(peer, now).seconds -= seconds * cost / total

    def next_refill(self, peers: list[Peer], now: float) -> float:
        """When the first of these (waiting) clients has budget again."""
        waits = [(-self._bucket(p, now).seconds + 1e-6) / self.limits.share for p in peers]
        return now + max(0.0, min(waits, default=0.0))

    def _bucket(self, peer: Peer, now: float) -> _Bucket:
        bucket = self._clients.setdefault(peer, _Bucket(self.limits.burst_s, now))
        bucket.seconds = min(self.limits.burst_s, bucket.seconds + (now - bucket.at) * self.limits.share)
        bucket.at = now
        return bucket
