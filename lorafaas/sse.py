"""The project's one SSE client: the events of a streaming HTTP response, parsed by httpx-sse, data read as JSON.

lorafaas's native stream sends each event's data as one JSON document and names its error events `error`; the
OpenAI-compatible stream sends `{"error": {...}}` documents on failure and ends with `data: [DONE]`. Callers open the
request themselves (what a refused request means differs: an exception, a failed sample, a result row), check its
status, then read `events(reply)` or `aevents(reply)`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import httpx
from httpx_sse import EventSource, ServerSentEvent

DONE = "[DONE]"


@dataclass(frozen=True)
class Event:
    name: str  # "message" unless the server named the event
    data: dict | None  # the JSON document; None for the OpenAI stream's closing [DONE]

    @property
    def done(self) -> bool:
        return self.data is None

    @property
    def error(self) -> dict | None:
        """The error this event reports: an `error` event, or a document holding only an error (OpenAI's form)."""
        if self.data is None:
            return None
        if self.name == "error":
            return self.data.get("error", self.data)
        if "error" in self.data and "type" not in self.data and "choices" not in self.data:
            return self.data["error"]
        return None


def _parsed(sse: ServerSentEvent) -> Event:
    return Event(sse.event, None if sse.data == DONE else json.loads(sse.data))


def events(reply: httpx.Response) -> Iterator[Event]:
    """The events of an open streaming response (raises ValueError on a data line that is not JSON)."""
    for sse in EventSource(reply).iter_sse():
        yield _parsed(sse)


async def aevents(reply: httpx.Response) -> AsyncIterator[Event]:
    """`events` for an async client."""
    async for sse in EventSource(reply).aiter_sse():
        yield _parsed(sse)
