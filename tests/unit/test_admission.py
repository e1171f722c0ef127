"""The agent's admission queue releases requests as the scheduler's batch policy decides (fill-or-expire)."""

import asyncio
import time
from dataclasses import dataclass

from lorafaas.errors import FunctionNotFound, ServerError
from lorafaas.platform.admission import Admission
from lorafaas.platform.state.records import FunctionSpec
from lorafaas.scheduler import Scheduler, SchedulerConfig


@dataclass
class Slot:
    """Stands in for an instance: the admission only reads and bumps `in_flight`."""

    in_flight: int = 0


def spec(slo_ttft_ms: int = 1000) -> FunctionSpec:
    return FunctionSpec(name="fn", tenant="t", backbone="b", adapter_digest="0" * 64, slo_ttft_ms=slo_ttft_ms,
                        created_at=0.0, updated_at=0.0)


def admission(config: SchedulerConfig, slot: Slot, fill_or_expire: bool = False) -> Admission:
    scheduler = Scheduler(config)

    async def acquire(spec: FunctionSpec, wanted: int):
        cap = scheduler.batch_policy(spec.name, spec.slo_ttft_ms / 1e3).max_batch_size
        return (slot, cap - slot.in_flight) if slot.in_flight < cap else None

    return Admission(scheduler, time.monotonic, acquire, fill_or_expire)


def test_a_full_batch_is_released_at_once_to_one_instance() -> None:
    slot = Slot()

    async def scenario():
        gate = admission(SchedulerConfig(max_batch_size=8), slot)
        return await asyncio.gather(*(gate.admit(spec()) for _ in range(8)))

    admitted = asyncio.run(scenario())
    assert [a.batch_size for a in admitted] == [8] * 8
    assert slot.in_flight == 8


def test_with_fill_or_expire_a_partial_batch_waits_for_its_deadline_then_goes() -> None:
    slot = Slot()

    async def scenario():
        config = SchedulerConfig(max_batch_size=8, prior_t0_s=0.05, prior_per_request_s=0.01)
        gate = admission(config, slot, fill_or_expire=True)
        started = time.monotonic()
        admitted = await asyncio.gather(gate.admit(spec(slo_ttft_ms=300)), gate.admit(spec(slo_ttft_ms=300)))
        return admitted, time.monotonic() - started

    admitted, waited = asyncio.run(scenario())
    assert [a.batch_size for a in admitted] == [2, 2]
    assert waited >= 0.2, "d = SLO - T(2) = 0.3 - 0.06 s: the batch waits for more requests first"


def test_by_default_a_lone_request_goes_at_once_and_the_batch_cap_bounds_an_instance() -> None:
    slot = Slot()

    async def scenario():
        gate = admission(SchedulerConfig(max_batch_size=3), slot)
        started = time.monotonic()
        first = await gate.admit(spec())
        waited = time.monotonic() - started
        more = [asyncio.create_task(gate.admit(spec())) for _ in range(3)]
        await asyncio.sleep(0.2)
        return first, waited, [t.done() for t in more], more

    first, waited, done, _ = asyncio.run(scenario())
    assert first.batch_size == 1 and waited < 0.5, "continuous batching: no waiting for a batch to fill"
    assert done == [True, True, False], "at most 3 (B) requests in flight on the instance"
    assert slot.in_flight == 3


def test_fixed_batch_of_one_keeps_one_request_in_flight_in_arrival_order() -> None:
    slot = Slot()
    order: list[int] = []

    async def scenario():
        gate = admission(SchedulerConfig(max_batch_size=1, adaptive_batching=False), slot)

        async def request(i: int) -> None:
            admitted = await gate.admit(spec())
            assert slot.in_flight == 1 and admitted.batch_size == 1
            order.append(i)
            await asyncio.sleep(0.01)
            slot.in_flight -= 1
            gate.wake("fn")

        await asyncio.gather(*(request(i) for i in range(4)))

    asyncio.run(scenario())
    assert order == [0, 1, 2, 3]
    assert slot.in_flight == 0


def test_a_cancelled_caller_leaves_the_queue_without_taking_a_place() -> None:
    slot = Slot(in_flight=1)  # full: nothing can be released yet

    async def scenario():
        gate = admission(SchedulerConfig(max_batch_size=1, adaptive_batching=False), slot)
        waiting = asyncio.create_task(gate.admit(spec()))
        await asyncio.sleep(0.05)
        waiting.cancel()
        await asyncio.sleep(0.01)
        slot.in_flight = 0
        gate.wake("fn")
        admitted = await asyncio.wait_for(gate.admit(spec()), 5)
        return admitted

    admitted = asyncio.run(scenario())
    assert admitted.batch_size == 1 and slot.in_flight == 1


def test_a_failed_queue_fails_its_waiting_requests_at_once_and_later_arrivals_queue_anew() -> None:
    slot = Slot(in_flight=1)

    async def scenario():
        gate = admission(SchedulerConfig(max_batch_size=1, adaptive_batching=False), slot)
        waiting = [asyncio.create_task(gate.admit(spec())) for _ in range(3)]
        await asyncio.sleep(0.05)
        failed = gate.fail(lambda identity: identity.function == "fn", FunctionNotFound("fn was deleted"))
        results = await asyncio.gather(*waiting, return_exceptions=True)
        slot.in_flight = 0
        later = await asyncio.wait_for(gate.admit(spec()), 5)
        return failed, results, later

    failed, results, later = asyncio.run(scenario())
    assert failed == 3 and all(isinstance(r, FunctionNotFound) for r in results)
    assert later.instance is slot


def test_a_bug_in_acquire_fails_the_queue_instead_of_hanging_it() -> None:
    async def scenario():
        async def broken(_spec: FunctionSpec, _wanted: int):
            raise ValueError("list.remove(x): x not in list")

        gate = Admission(Scheduler(SchedulerConfig()), time.monotonic, broken)
        return await asyncio.wait_for(asyncio.gather(gate.admit(spec()), gate.admit(spec()),
                                                     return_exceptions=True), 5)

    results = asyncio.run(scenario())
    assert all(isinstance(r, ServerError) and "admission failed" in r.message for r in results)
