"""The pool of pre-forked, not-yet-assigned worker processes: per backbone (and device and thread count), up to
`size` processes forked from the zygote that have attached the backbone and run a warm-up forward pass
(function_runtime/standby.py), so that a new function's start skips the fork, the attach and the first-prefill costs.

`take` hands one out for good: it leaves the pool at once and is never returned, whether its assignment succeeds or
not (a failed one is killed), so a process serves one function for its whole life. `refill` tops the pool up in a
background thread, after `refill_delay_s` so that the start just served has the cores for its first token.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from lorafaas.errors import LorafaasError
from lorafaas.function_runtime import messages as m
from lorafaas.function_runtime.standby import STANDBY_FUNCTION
from lorafaas.function_runtime.zygote import wait_for_socket

log = logging.getLogger(__name__)
DEFAULT_STANDBY_WORKERS = 1  # per backbone and device: one new function at a time starts from the pool
REFILL_DELAY_S = 1.0  # after a start took one: its first token first (a pool process's warm-up takes a core)
PoolKey = tuple[str, str | None, str, int | None]  # model dir, daemon socket, device, threads


@dataclass(frozen=True)
class Standby:
    pid: int
    spec: m.WorkerSpec  # what it was started with: no function (STANDBY_FUNCTION), its own socket


def pool_key(spec: m.WorkerSpec) -> PoolKey:
    return (spec.model_dir, spec.daemon_socket, spec.device, spec.num_threads)


class StandbyPool:
    def __init__(self, size: int, run_dir: Path, spawn: Callable[[m.WorkerSpec], int],
                 refill_delay_s: float = REFILL_DELAY_S) -> None:
        """`spawn(spec)`: fork a pool process from the zygote, returning its pid."""
        if size < 0:
            raise ValueError(f"standby workers is {size}; it must be >= 0")
        self.size = size
        self.run_dir = run_dir
        self._spawn = spawn
        self.refill_delay_s = refill_delay_s
        self._lock = threading.Lock()
        self._ready: dict[PoolKey, list[Standby]] = {}
        self._starting: dict[PoolKey, int] = {}
        self._closing = threading.Event()
        self._spawned: dict[int, Standby] = {}  # forked, not yet listening
        self._refills: set[threading.Thread] = set()
        self.num_assigned = 0  # handed out (each once)

    def eligible(self, spec: m.WorkerSpec) -> bool:
        """Only instances binding a backbone daemon start from the pool (its processes attach the shared segment)."""
        return self.size > 0 and spec.daemon_socket is not None

    def take(self, spec: m.WorkerSpec) -> Standby | None:
        """A ready pool process for `spec`'s backbone, out of the pool for good; None if none is ready."""
        if not self.eligible(spec):
            return None
        with self._lock:
            ready = self._ready.get(pool_key(spec), [])
            while ready:
                standby = ready.pop(0)
                if _alive(standby.pid):
                    self.num_assigned += 1
                    return standby
                discard(standby)
        return None

    def pids(self) -> list[int]:
        """The pool processes ready now (not those handed out: they are instances)."""
        with self._lock:
            return [s.pid for ready in self._ready.values() for s in ready]

    def refill(self, spec: m.WorkerSpec, delay_s: float | None = None) -> None:
        """Start, in the background, as many pool processes for `spec`'s backbone as it lacks."""
        if not self.eligible(spec) or self._closing.is_set():
            return
        key = pool_key(spec)
        with self._lock:
            missing = self.size - len(self._ready.get(key, [])) - self._starting.get(key, 0)
            if missing <= 0:
                return
            self._starting[key] = self._starting.get(key, 0) + missing
        delay = self.refill_delay_s if delay_s is None else delay_s
        for _ in range(missing):
            thread = threading.Thread(target=self._start_one, args=(spec, key, delay), name="standby-refill",
                                      daemon=True)
            with self._lock:
                self._refills.add(thread)
            thread.start()

    def _start_one(self, spec: m.WorkerSpec, key: PoolKey, delay_s: float) -> None:
        standby: Standby | None = None
        try:
            if self._closing.wait(delay_s):
                return
            token = secrets.token_hex(4)
            standby_spec = msgspec.structs.replace(
                spec, function=STANDBY_FUNCTION, instance_id=f"standby-{token}", deployment=None,
                socket_path=str(self.run_dir / f"standby-{token}.sock"), adapter_dir=None, step_gate=None,
                base_pass=None, lora_mode=None, lora_server=None)
            standby = Standby(self._spawn(standby_spec), standby_spec)
            with self._lock:
                self._spawned[standby.pid] = standby
            if self._closing.is_set():  # close() may have looked before it was recorded
                raise LorafaasError("the pool is closing")
            wait_for_socket(Path(standby_spec.socket_path), 120.0, standby.pid)
        except (LorafaasError, OSError) as exc:
            if not self._closing.is_set():
                log.warning("a pool process for %s did not start: %s", spec.model_dir, exc)
            if standby is not None:
                discard(standby)
            return
        finally:
            with self._lock:
                self._starting[key] -= 1
                if standby is not None:
                    self._spawned.pop(standby.pid, None)
                self._refills.discard(threading.current_thread())
        with self._lock:
            if not self._closing.is_set():
                self._ready.setdefault(key, []).append(standby)
                log.info("pool process %d ready for %s", standby.pid, spec.model_dir)
                return
        discard(standby)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every pool process not handed out, those still starting included, and remove their sockets; nothing
        is started any more. Waits (up to `timeout_s`) for the refills under way to end, so that none leaves a
        process or a socket behind the pool's owner."""
        self._closing.set()
        with self._lock:
            doomed = [s for group in self._ready.values() for s in group] + list(self._spawned.values())
            self._ready.clear()
            refills = list(self._refills)
        for standby in doomed:
            discard(standby)
        deadline = time.monotonic() + timeout_s
        for thread in refills:
            thread.join(max(0.0, deadline - time.monotonic()))


def discard(standby: Standby) -> None:
    """Kill a pool process that will serve nothing and remove its socket (SIGKILL leaves it on disk)."""
    _kill(standby.pid)
    Path(standby.spec.socket_path).unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)  # the zygote reaps it (its child)
