"""The invocations in flight in this gateway, by id and by API key, so that revoking a key or cancelling an
invocation reaches work already accepted (streams, synchronous requests, queued or running async invocations).

Each invocation holds a `Ticket` while it runs. Cancelling a ticket sets its reason (KeyRevoked,
InvocationCancelled) and, if the invocation is waiting for its next event at that moment, cancels the waiting task;
`Ticket.wait` turns that cancellation into the reason, raised where the invocation waited, so it ends as any failed
invocation ends: its generation stopped on the instance, an error to its client (a 401, or an SSE `error` event once
the headers are sent), and the work produced until then charged (service.py). A cancellation that is not the
ticket's (the client left, the platform stops) passes through unchanged (the count of `Task.cancelling()` tells them
apart, as `asyncio.timeout` does). One event loop owns all of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from lorafaas.errors import KeyRevoked, LorafaasError

T = TypeVar("T")


@dataclass(eq=False)
class Ticket:
    invocation_id: str
    key_id: str
    reason: LorafaasError | None = None
    _waiting: asyncio.Task | None = None  # the task waiting for the invocation's next event, while it waits
    _cancelling: int = 0  # that task's cancel requests before it waited

    def cancel(self, reason: LorafaasError) -> None:
        if self.reason is not None:
            return
        self.reason = reason
        if self._waiting is not None:
            self._waiting.cancel()

    def check(self) -> None:
        """Raise the reason if the ticket was cancelled."""
        if self.reason is not None:
            raise type(self.reason)(self.reason.message)

    async def wait(self, next_event: Callable[[], Awaitable[T]]) -> T:
        """`await next_event()`, unless the ticket is cancelled before or meanwhile: then its reason is raised."""
        self.check()
        task = asyncio.current_task()
        assert task is not None
        self._waiting, self._cancelling = task, task.cancelling()
        try:
            return await next_event()
        except asyncio.CancelledError:
            if self.reason is not None and task.uncancel() <= self._cancelling:
                raise type(self.reason)(self.reason.message) from None
            raise
        finally:
            self._waiting = None


@dataclass
class InFlight:
    tickets: dict[str, Ticket] = field(default_factory=dict)  # by invocation id
    revoked_key_ids: set[str] = field(default_factory=set)  # a ticket opened for one is cancelled at once

    def open(self, invocation_id: str, key_id: str) -> Ticket:
        ticket = Ticket(invocation_id, key_id)
        if key_id in self.revoked_key_ids:
            ticket.cancel(_revoked(key_id))
        self.tickets[invocation_id] = ticket
        return ticket

    def close(self, ticket: Ticket) -> None:
        if self.tickets.get(ticket.invocation_id) is ticket:
            del self.tickets[ticket.invocation_id]

    def revoke(self, key_id: str) -> int:
        """Cancel every invocation of the key, now and from now on; returns how many were in flight."""
        self.revoked_key_ids.add(key_id)
        mine = [ticket for ticket in self.tickets.values() if ticket.key_id == key_id]
        for ticket in mine:
            ticket.cancel(_revoked(key_id))
        return len(mine)

    def cancel(self, invocation_id: str, reason: LorafaasError) -> bool:
        """Cancel one invocation; False if it is not in flight here."""
        ticket = self.tickets.get(invocation_id)
        if ticket is None:
            return False
        ticket.cancel(reason)
        return True


def _revoked(key_id: str) -> KeyRevoked:
    return KeyRevoked(f"API key {key_id!r} was revoked while this invocation was in flight; it was cancelled")
