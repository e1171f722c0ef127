"""Invocations in flight (platform/in_flight.py): a revoke or cancel surfaces as its reason where the invocation waits;
any other cancellation passes through unchanged."""

import asyncio

import pytest

from lorafaas.errors import InvocationCancelled, KeyRevoked
from lorafaas.platform.in_flight import InFlight


def test_a_revoke_raises_key_revoked_where_the_invocation_waits_and_cancels_later_ones_at_once() -> None:
    async def scenario() -> None:
        in_flight = InFlight()
        mine, other = in_flight.open("i1", "k1"), in_flight.open("i2", "k2")
        never = asyncio.get_running_loop().create_future()
        waiting = asyncio.create_task(mine.wait(lambda: never))
        await asyncio.sleep(0)
        assert in_flight.revoke("k1") == 1
        with pytest.raises(KeyRevoked, match="'k1' was revoked"):
            await waiting
        assert not waiting.cancelled() and other.reason is None
        with pytest.raises(KeyRevoked):  # opened after the revoke: cancelled before it waits
            await in_flight.open("i3", "k1").wait(asyncio.sleep)
        in_flight.close(mine)
        assert set(in_flight.tickets) == {"i2", "i3"}

    asyncio.run(scenario())


def test_a_cancel_between_events_is_raised_at_the_next_wait_and_other_cancellations_pass_through() -> None:
    async def scenario() -> None:
        in_flight = InFlight()
        ticket = in_flight.open("i1", "k1")
        assert await ticket.wait(lambda: asyncio.sleep(0, "first")) == "first"
        assert in_flight.cancel("i1", InvocationCancelled("cancelled by its tenant"))
        assert not in_flight.cancel("nope", InvocationCancelled("x"))
        with pytest.raises(InvocationCancelled):
            await ticket.wait(lambda: asyncio.sleep(0))
        untouched = in_flight.open("i2", "k2")
        task = asyncio.create_task(untouched.wait(lambda: asyncio.sleep(60)))
        await asyncio.sleep(0)
        task.cancel()  # the client left: not the ticket's cancellation
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
