"""Admission queues at the node agent: requests wait here until an instance of their exact identity takes them.

A request is queued under the identity of the spec it was accepted with (tenant, function, deployment uid, version,
adapter). One dispatcher task per queue owns it (no locks: the event loop serialises it) and asks the node agent,
`acquire(spec, n)`, for an instance that takes up to `n` of its requests now; the agent carries out the scheduler's
admission policy (`lorafaas.scheduler.admission`), or raises to fail the queue (the function was deleted, say).

Because the worker batches continuously, requests go as soon as an instance has room. With `fill_or_expire` the
paper's rule holds them instead: released when B are queued or the oldest has waited d = SLO - T(N) (for workers
that run a batch as a unit).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from lorafaas.errors import InstanceUnavailable, LorafaasError, ServerError
from lorafaas.platform.instance_table import Identity, Instance
from lorafaas.platform.state.records import FunctionSpec
from lorafaas.scheduler import FunctionName, Scheduler

log = logging.getLogger(__name__)
POLL_S = 0.05  # a queue whose instances are all full looks again this often (and at every request's end)


@dataclass
class Admitted:
    """A request's place in an instance: the instance (its in-flight count already includes the request) and the size
    of the batch it was dispatched in."""

    instance: Instance
    batch_size: int


@dataclass
class _Waiter:
    enqueued_s: float
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass
class _Queue:
    spec: FunctionSpec
    waiters: collections.deque[_Waiter] = field(default_factory=collections.deque)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    dispatcher: asyncio.Task | None = None

    def __len__(self) -> int:
        return sum(1 for w in self.waiters if not w.future.done())


Acquire = Callable[[FunctionSpec, int], Awaitable[tuple[Instance, int] | None]]


class Admission:
    def __init__(self, scheduler: Scheduler, clock: Callable[[], float], acquire: Acquire,
                 fill_or_expire: bool = False) -> None:
        """`acquire(spec, n)`: an instance that takes up to how many of `n` queued requests now, or None to wait;
        it raises a LorafaasError that fails every request of the queue."""
        self.scheduler = scheduler
        self.clock = clock
        self.acquire = acquire
        self.fill_or_expire = fill_or_expire
        self._queues: dict[Identity, _Queue] = {}

    async def admit(self, spec: FunctionSpec) -> Admitted:
        identity = Identity.of(spec)
        queue = self._queues.get(identity)
        if queue is None:
            queue = self._queues[identity] = _Queue(spec)
        waiter = _Waiter(self.clock())
        queue.waiters.append(waiter)
        queue.wakeup.set()
        if queue.dispatcher is None or queue.dispatcher.done():
            queue.dispatcher = asyncio.create_task(self._dispatch(identity, queue))
        return await waiter.future

    def wake(self, function: str) -> None:
        """Something changed for `function` (a request finished, an instance started or went): its queues look
        again."""
        for identity, queue in self._queues.items():
            if identity.function == function:
                queue.wakeup.set()

    def queue_length(self, identity: Identity) -> int:
        queue = self._queues.get(identity)
        return len(queue) if queue is not None else 0

    def queued(self, function: str) -> int:
        return sum(len(q) for identity, q in self._queues.items() if identity.function == function)

    def fail(self, matches: Callable[[Identity], bool], exc: LorafaasError) -> int:
        """Fail at once every request still queued under an identity that `matches` (e.g. a deleted deployment's);
        returns how many."""
        failed = 0
        for identity, queue in list(self._queues.items()):
            if matches(identity):
                failed += _fail(queue.waiters, exc)
                queue.wakeup.set()
        return failed

    def max_batch_size(self, spec: FunctionSpec) -> int:
        return self.scheduler.batch_policy(FunctionName(spec.name), spec.slo_ttft_ms / 1e3).max_batch_size

    async def _dispatch(self, identity: Identity, queue: _Queue) -> None:
        waiters = queue.waiters
        try:
            while True:
                while waiters and waiters[0].future.done():  # its caller went away, or it was failed
                    waiters.popleft()
                if not waiters:
                    return
                spec = queue.spec
                queue.wakeup.clear()
                wanted = len(queue)
                if self.fill_or_expire:
                    now = self.clock()
                    decision = self.scheduler.decide_batch(FunctionName(spec.name), spec.slo_ttft_ms / 1e3, wanted,
                                                           now - waiters[0].enqueued_s, now)
                    if not decision.dispatch:
                        await _wait(queue.wakeup, decision.wait_s)
                        continue
                    wanted = decision.size
                acquired = await self.acquire(spec, wanted)
                if acquired is None:
                    await _wait(queue.wakeup, POLL_S)
                    continue
                instance, room = acquired
                _release(waiters, instance, min(wanted, room))
        except asyncio.CancelledError:
            _fail(waiters, InstanceUnavailable("the node agent is stopping"))
            raise
        except LorafaasError as exc:  # e.g. the function was deleted, or a cold start failed
            _fail(waiters, exc)
        except Exception as exc:  # a bug must fail the queue's requests, never leave them waiting for their deadline
            log.exception("%s: admission failed", identity.function)
            _fail(waiters, ServerError(f"function {identity.function}: admission failed ({type(exc).__name__})"))
        finally:
            if self._queues.get(identity) is queue and not waiters:
                del self._queues[identity]


def _fail(waiters: collections.deque[_Waiter], exc: Exception) -> int:
    failed = 0
    for waiter in waiters:
        if not waiter.future.done():
            waiter.future.set_exception(exc)
            failed += 1
    waiters.clear()
    return failed


def _release(waiters: collections.deque[_Waiter], instance: Instance, size: int) -> None:
    taken: list[_Waiter] = []
    while waiters and len(taken) < max(1, size):
        waiter = waiters.popleft()
        if not waiter.future.done():
            taken.append(waiter)
    for waiter in taken:
        instance.in_flight += 1
        waiter.future.set_result(Admitted(instance, len(taken)))


async def _wait(event: asyncio.Event, timeout_s: float | None) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout_s)
