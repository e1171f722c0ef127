"""The host tier: sealed CPU backbone segments kept after their daemon stops, so that the next daemon of the backbone
on this node adopts one instead of reading the store again (a scale-out on a node that held it loads at memory speed:
nothing is copied at all).

When the launcher stops a CPU daemon (its backbone unloaded: no instance left, or offloaded) it keeps the duplicate
of the segment's descriptor it already held, with the daemon's segment record (leases dropped), here, within
`budget_bytes`, least recently kept first out. A daemon started later for the same backbone and device gets both
back (the record rewritten, the descriptor as `--adopt-fd`) and runs the adoption checks of a restarted daemon
(adoption.py: same backbone and weights digest as the store's now, same inode and size, sealed), loading from the
store if any fails. A segment is evicted when the budget is full, when a daemon about to start needs the memory it
takes (`make_room`), and when the launcher closes.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from lorafaas.backbone_daemon import adoption
from lorafaas.cuda_ipc.memfd import available_memory_bytes
from lorafaas.protocols import daemon_messages as m
from lorafaas.protocols.daemon_config import DaemonConfig

log = logging.getLogger(__name__)

DEFAULT_HOST_TIER_FRACTION = 0.25  # of the node's memory, at most DEFAULT_HOST_TIER_MAX_BYTES
DEFAULT_HOST_TIER_MAX_BYTES = 8 * 1024**3


def default_host_tier_bytes(total_memory_bytes: int) -> int:
    return min(int(total_memory_bytes * DEFAULT_HOST_TIER_FRACTION), DEFAULT_HOST_TIER_MAX_BYTES)


@dataclass(frozen=True)
class KeptSegment:
    record: m.SegmentRecord  # what the daemon recorded, leases dropped
    fd: int  # owned by the tier until taken

    @property
    def nbytes(self) -> int:
        return self.record.manifest.size


class HostTier:
    """Kept segments by (backbone, device), least recently kept first; thread-safe."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"the host tier's budget is {budget_bytes} bytes; it must be 0 (off) or more")
        self.budget_bytes = budget_bytes
        self._kept: OrderedDict[tuple[str, str], KeptSegment] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def kept_bytes(self) -> int:
        with self._lock:
            return self._kept_bytes()

    def _kept_bytes(self) -> int:  # under the lock
        return sum(k.nbytes for k in self._kept.values())

    def keys(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self._kept)

    def keep(self, key: tuple[str, str], record: m.SegmentRecord, fd: int) -> bool:
        """Keep the segment (the tier owns `fd` from now on); False if it exceeds the budget (the caller keeps `fd`)."""
        kept = KeptSegment(msgspec.structs.replace(record, leases=()), fd)
        if kept.nbytes > self.budget_bytes:
            return False
        with self._lock:
            evicted = [self._kept.pop(key)] if key in self._kept else []
            while self._kept and self._kept_bytes() + kept.nbytes > self.budget_bytes:
                evicted.append(self._kept.popitem(last=False)[1])
            self._kept[key] = kept
        self._close(evicted, "the host tier's budget is full")
        log.info("host tier: keeping the segment of %s on %s (%d bytes; %d kept in all)", key[0], key[1],
                 kept.nbytes, self.kept_bytes)
        return True

    def take(self, key: tuple[str, str]) -> KeptSegment | None:
        """The kept segment of `key`, now the caller's (it closes the descriptor), or None."""
        with self._lock:
            return self._kept.pop(key, None)

    def make_room(self, needed_bytes: int, available_bytes: Callable[[], int]) -> None:
        """Evict the least recently kept segments until `available_bytes()` covers `needed_bytes` (or none is left)."""
        while available_bytes() < needed_bytes:
            with self._lock:
                if not self._kept:
                    return
                _key, kept = self._kept.popitem(last=False)
            self._close([kept], f"a daemon needs {needed_bytes} bytes")

    def clear(self) -> None:
        with self._lock:
            evicted, self._kept = list(self._kept.values()), OrderedDict()
        self._close(evicted, "the launcher closes")

    @staticmethod
    def _close(evicted: list[KeptSegment], why: str) -> None:
        for kept in evicted:
            os.close(kept.fd)  # the memory goes with the last descriptor (no daemon maps it any more)
            log.info("host tier: dropped the segment of %s (%d bytes): %s", kept.record.backbone.name, kept.nbytes,
                     why)


def keep_stopping_daemon(tier: HostTier, config: DaemonConfig, segment_fd: int | None) -> bool:
    """Before a CPU daemon is stopped: keep its segment (the launcher's duplicate `segment_fd`, the tier's if kept)
    with the record it wrote, which a clean stop removes."""
    if config.device != "cpu" or segment_fd is None or tier.budget_bytes == 0:
        return False
    record = adoption.read_record(config.paths.record)
    if record is None:
        return False
    return tier.keep((config.backbone, config.device), record, segment_fd)


def hand_back(tier: HostTier, config: DaemonConfig, needed_bytes: int) -> int | None:
    """Before a daemon starts: the kept segment of its backbone as a descriptor to adopt (its record written back
    where the daemon reads it; the caller closes the descriptor once the daemon is up), or None. Other kept segments
    are evicted while the node lacks the memory the daemon may need."""
    kept = tier.take((config.backbone, config.device))
    if kept is None:
        tier.make_room(needed_bytes, available_memory_bytes)
        return None
    adoption.write_record(config.paths.record, kept.record)
    log.info("host tier: handing the kept segment of %s on %s to its new daemon", config.backbone, config.device)
    return kept.fd
