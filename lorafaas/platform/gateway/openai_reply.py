"""One OpenAI request's choices (one invocation each) shaped as a (chat) completion, or as its stream of chunks.

Choices are indexed as vLLM indexes them: prompt p's i-th sample is choice p * n + i. Usage sums the choices'
completion tokens and counts each prompt's tokens once, however many samples it has.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator

from lorafaas.errors import LorafaasError, ServerError
from lorafaas.function_runtime import messages as m
from lorafaas.platform.gateway.streaming import InvocationEvents, error_body, sse
from lorafaas.platform.service import FunctionService


class ChoicesReply:
    def __init__(self, model: str, chat: bool, service: FunctionService, n: int) -> None:
        self.service, self.model, self.chat, self.n = service, model, chat, n
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"

    async def whole(self, choices: list[InvocationEvents]) -> dict:
        tasks = [asyncio.create_task(_finished(events)) for events in choices]
        try:
            finished = await asyncio.gather(*tasks)
        finally:  # a choice that failed (or a client gone) stops the others' generations too
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return self._envelope(self.object, [self._choice(i, event) for i, event in enumerate(finished)]) | {
            "usage": self._usage(finished)}

    async def stream(self, choices: list[InvocationEvents], include_usage: bool) -> AsyncIterator[bytes]:
        queue: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.create_task(_pump(index, events, queue)) for index, events in enumerate(choices)]
        finished: dict[int, m.Finished] = {}
        try:
            if self.chat:
                for index in range(len(choices)):
                    yield self._chunk([self._delta(index, {"role": "assistant", "content": ""}, None)])
            while len(finished) < len(choices):
                index, event = await queue.get()
                if isinstance(event, LorafaasError):
                    raise event
                if isinstance(event, m.Token) and event.text:
                    yield self._chunk([self._delta(index, {"content": event.text}, None, event.text)])
                elif isinstance(event, m.Finished):
                    finished[index] = event
                    yield self._chunk([self._delta(index, {}, _finish(event))])
            if include_usage:
                in_order = [finished[index] for index in range(len(choices))]
                yield sse(self._envelope(self.chunk_object, []) | {"usage": self._usage(in_order)})
            yield sse("[DONE]")
        except LorafaasError as exc:  # the headers are sent: the error travels as the last event
            yield sse(error_body(exc, self.service))
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    def _choice(self, index: int, event: m.Finished) -> dict:
        choice = {"index": index, "finish_reason": _finish(event), "logprobs": None}
        if self.chat:
            return choice | {"message": {"role": "assistant", "content": event.text}}
        return choice | {"text": event.text}

    def _delta(self, index: int, delta: dict, finish_reason: str | None, text: str = "") -> dict:
        if self.chat:
            return {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": None}

    def _chunk(self, choices: list[dict]) -> bytes:
        return sse(self._envelope(self.chunk_object, choices))

    def _envelope(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _usage(self, finished: list[m.Finished]) -> dict:
        prompt_tokens = sum(event.prompt_tokens for event in finished[::self.n])
        completion_tokens = sum(event.completion_tokens for event in finished)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}


async def _finished(events: InvocationEvents) -> m.Finished:
    async for event in events:
        if isinstance(event, m.Finished):
            return event
    raise ServerError("the instance ended the request without a result")


async def _pump(index: int, events: InvocationEvents, queue: asyncio.Queue) -> None:
    """One choice's events into the shared queue, ending with its Finished or the error that ended it."""
    try:
        async for event in events:
            await queue.put((index, event))
            if isinstance(event, m.Finished):
                return
    except LorafaasError as exc:
        await queue.put((index, exc))
        return
    await queue.put((index, ServerError("the instance ended the request without a result")))


def _finish(event: m.Finished) -> str:
    return "length" if event.finish_reason == "length" else "stop"
