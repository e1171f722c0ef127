"""A started invocation as the HTTP layer streams it: its events, SSE framing, usage and error bodies.

Shared by lorafaas' own API and the OpenAI-compatible one.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncGenerator, Iterator

from lorafaas.errors import ClientError, FunctionNotFound, LorafaasError
from lorafaas.function_runtime import messages as m
from lorafaas.platform.gateway.metrics import GatewayMetrics
from lorafaas.platform.service import FunctionService
from lorafaas.platform.state.records import ApiKeyRecord, InvocationRequest

UNKNOWN_FUNCTION = "(unknown)"  # no function name can contain parentheses


class InvocationEvents:
    """A started invocation: its first event already received (so errors before it became HTTP errors)."""

    def __init__(self, first, rest: AsyncGenerator, function: str, metrics: GatewayMetrics, started: float) -> None:
        self.first, self.rest, self.function, self.metrics, self.started = first, rest, function, metrics, started
        self.ttft_s = time.perf_counter() - started

    async def __aiter__(self):
        finished = None
        try:
            event = self.first
            while True:
                if isinstance(event, m.Finished):
                    finished = event
                yield event
                if finished is not None:
                    return
                try:
                    event = await anext(self.rest)
                except StopAsyncIteration:
                    return
        finally:
            # Closed at once, whether it finished or not (the client went away, the instance failed: the generation
            # stops too): the invocation leaves the gateway's in-flight table now, not when it is collected.
            await self.rest.aclose()
            self.metrics.observe(self.function, "succeeded" if finished else "failed", self.ttft_s,
                                 time.perf_counter() - self.started, finished.completion_tokens if finished else 0)


async def start_invocation(service: FunctionService, metrics: GatewayMetrics, who: ApiKeyRecord, name: str,
                           invocation: InvocationRequest, charge_prompt: bool = True) -> InvocationEvents:
    """`charge_prompt` False: another invocation of the same request is charged the prompt (OpenAI's `n`)."""
    started = time.perf_counter()
    stream = service.invoke(who, name, invocation, charge_prompt)
    with counted_refusals(metrics, name):
        first = await anext(stream)
    return InvocationEvents(first, stream, name, metrics, started)


@contextlib.contextmanager
def counted_refusals(metrics: GatewayMetrics, name: str) -> Iterator[None]:
    """A LorafaasError raised inside counts as a rejected (client error) or failed invocation of `name`: also for the
    checks a route makes before it starts the invocation."""
    try:
        yield
    except LorafaasError as exc:
        # A name that is not (the caller's) function gets one shared label: requested names are the caller's to
        # choose, and one series per name would let a client grow /metrics and the gateway's memory without bound.
        label = UNKNOWN_FUNCTION if isinstance(exc, FunctionNotFound) else name
        metrics.observe(label, "rejected" if isinstance(exc, ClientError) else "failed")
        raise


def sse(document: dict | str, event: str | None = None) -> bytes:
    data = document if isinstance(document, str) else json.dumps(document, ensure_ascii=False)
    return (f"event: {event}\n" if event else "").encode() + f"data: {data}\n\n".encode()


def usage(event: m.Finished) -> dict:
    return {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens,
            "total_tokens": event.prompt_tokens + event.completion_tokens}


def error_body(exc: LorafaasError, service: FunctionService) -> dict:
    kind = "invalid_request_error" if isinstance(exc, ClientError) else "server_error"
    return {"error": {"code": exc.code, "message": service.public_message(exc.message), "type": kind}}
