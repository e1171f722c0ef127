"""Adaptive batching at the node agent: per-function queues released in batches by the scheduler's batch policy.

B is the largest batch whose predicted prefill T(B) = T0 + a(B-1) meets the TTFT SLO; an instance holds at most B
requests in flight, and the worker batches them in its forward passes. Because the worker batches continuously
(requests join between decode steps), a request is dispatched as soon as an instance has room: waiting for a batch
to fill would only add delay. With `fill_or_expire` the paper's rule applies instead: the queue is released when it
holds B requests or when the oldest has waited d = SLO - T(N) (for workers that run a batch as a unit). With adaptive
batching off and a maximum batch of 1, every request is dispatched alone (the `fixed-batch` ablation).

One dispatcher task per function with queued requests owns its queue (no locks: the event loop serialises it).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from lorafaas.errors import InstanceUnavailable, LorafaasError
from lorafaas.platform.state.records import FunctionSpec
from lorafaas.scheduler import Scheduler


@dataclass
class Admitted:
    """A request's place in an instance: the instance (its in-flight count already includes the request) and the size
    of the batch it was dispatched in."""

    instance: object
    batch_size: int


@dataclass
class _Waiter:
    enqueued_s: float
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Admission:
    def __init__(
        self,
        scheduler: Scheduler,
        clock: Callable[[], float],
        acquire: Callable[[FunctionSpec, int], Awaitable[object | None]],
        fill_or_expire: bool = False,
    ) -> None:
        """`acquire(spec, cap)` returns an instance with fewer than `cap` requests in flight (starting one if the
        function may grow), or None when every instance is full."""
        self.scheduler = scheduler
        self.clock = clock
        self.acquire = acquire
        self.fill_or_expire = fill_or_expire
        self._queues: dict[str, collections.deque[_Waiter]] = {}
        self._specs: dict[str, FunctionSpec] = {}
        self._wakeups: dict[str, asyncio.Event] = {}
        self._dispatchers: dict[str, asyncio.Task] = {}

    async def admit(self, spec: FunctionSpec) -> Admitted:
        waiter = _Waiter(self.clock())
        self._queues.setdefault(spec.name, collections.deque()).append(waiter)
        self._specs[spec.name] = spec
        self.wake(spec.name)
        dispatcher = self._dispatchers.get(spec.name)
        if dispatcher is None or dispatcher.done():
            self._dispatchers[spec.name] = asyncio.create_task(self._dispatch(spec.name))
        return await waiter.future

    def wake(self, name: str) -> None:
        """Something changed for `name` (an arrival, a request finished): the dispatcher looks again."""
        self._wakeups.setdefault(name, asyncio.Event()).set()

    def queue_length(self, name: str) -> int:
        return sum(1 for w in self._queues.get(name, ()) if not w.future.done())

    def max_batch_size(self, spec: FunctionSpec) -> int:
        return self.scheduler.batch_policy(spec.name, spec.slo_ttft_ms / 1e3).max_batch_size

    async def _dispatch(self, name: str) -> None:
        queue = self._queues[name]
        wakeup = self._wakeups.setdefault(name, asyncio.Event())
        try:
            while True:
                while queue and queue[0].future.done():  # its caller went away
                    queue.popleft()
                if not queue:
                    return
                spec = self._specs[name]
                now = self.clock()
                cap = self.max_batch_size(spec)
                size = cap
                wakeup.clear()
                if self.fill_or_expire:
                    decision = self.scheduler.decide_batch(spec.name, spec.slo_ttft_ms / 1e3, len(queue),
                                                           now - queue[0].enqueued_s, now)
                    if not decision.dispatch:
                        await _wait(wakeup, decision.wait_s)
                        continue
                    size = decision.size
                instance = await self.acquire(spec, cap)
                if instance is None:  # every instance holds `cap` requests: wait for one to finish
                    await _wait(wakeup, 0.05)
                    continue
                self._release(queue, instance, min(size, cap - instance.in_flight))
        except asyncio.CancelledError:
            self._fail(queue, InstanceUnavailable("the node agent is stopping"))
            raise
        except LorafaasError as exc:  # e.g. a cold start failed: the waiting requests fail with it
            self._fail(queue, exc)

    @staticmethod
    def _fail(queue: collections.deque[_Waiter], exc: Exception) -> None:
        for waiter in queue:
            if not waiter.future.done():
                waiter.future.set_exception(exc)
        queue.clear()

    def _release(self, queue: collections.deque[_Waiter], instance, size: int) -> None:
        taken = []
        while queue and len(taken) < max(1, size):
            waiter = queue.popleft()
            if not waiter.future.done():
                taken.append(waiter)
        for waiter in taken:
            instance.in_flight += 1
            waiter.future.set_result(Admitted(instance, len(taken)))


async def _wait(event: asyncio.Event, timeout_s: float | None) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout_s)
