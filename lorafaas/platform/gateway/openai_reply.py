"""One OpenAI request's choices (one invocation each) shaped as a (chat) completion, or as its stream of chunks.

Choices are indexed as vLLM indexes them: prompt p's i-th sample is choice p * n + i. Usage sums the choices'
completion tokens and counts each prompt's tokens once, however many samples it has.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator

import msgspec

from lorafaas.errors import LorafaasError, ServerError
from lorafaas.function_runtime import messages as m
from lorafaas.platform.gateway.logprobs import ChatLogprobs, CompletionLogprobs, LogprobsShaper
from lorafaas.platform.gateway.streaming import InvocationEvents, error_body, sse
from lorafaas.platform.service import FunctionService


class ChoicesReply:
    """`logprobs`: (alternatives per token, show tokens as ids) when asked for; `echoes`: completions' prompt text
    shown before each choice's completion."""

    def __init__(self, model: str, chat: bool, service: FunctionService, n: int,
                 logprobs: tuple[int, bool] | None = None, echoes: list[str] | None = None) -> None:
        self.service, self.model, self.chat, self.n = service, model, chat, n
        self.logprobs = logprobs
        self.echoes = echoes
        self._shapers: dict[int, LogprobsShaper] = {}
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"

    async def whole(self, choices: list[InvocationEvents]) -> dict:
        tasks = [asyncio.create_task(finished_event(events, self._shaper(i))) for i, events in enumerate(choices)]
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
            for index in range(len(choices)):
                if self.chat:
                    yield self._chunk([self._delta(index, {"role": "assistant", "content": ""}, None)])
                elif self._echo(index):
                    yield self._chunk([self._delta(index, {}, None, self._echo(index))])
            while len(finished) < len(choices):
                index, event = await queue.get()
                if isinstance(event, LorafaasError):
                    raise event
                if isinstance(event, m.Token) and (shaper := self._shaper(index)) is not None:
                    shaper.add(event.logprobs)
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

    def _shaper(self, index: int) -> LogprobsShaper | None:
        if self.logprobs is None:
            return None
        if index not in self._shapers:
            self._shapers[index] = LogprobsShaper(self.chat, *self.logprobs)
        return self._shapers[index]

    def _take_logprobs(self, index: int) -> ChatLogprobs | CompletionLogprobs | None:
        shaper = self._shaper(index)
        return None if shaper is None else shaper.take()

    def _echo(self, index: int) -> str:
        return self.echoes[index] if self.echoes else ""

    def _choice(self, index: int, event: m.Finished) -> dict:
        choice = {"index": index, "finish_reason": _finish(event), "logprobs": self._take_logprobs(index)}
        if self.chat:
            return choice | {"message": {"role": "assistant", "content": event.text}}
        return choice | {"text": self._echo(index) + event.text}

    def _delta(self, index: int, delta: dict, finish_reason: str | None, text: str = "") -> dict:
        """A chunk's choice, carrying the logprobs of that choice's tokens since its last chunk (a token whose text
        is held back, a partial character or a possible stop string, has its entry in the chunk showing the text)."""
        logprobs = msgspec.to_builtins(self._take_logprobs(index))  # a chunk is encoded as built (`sse`)
        if self.chat:
            return {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
        return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}

    def _chunk(self, choices: list[dict]) -> bytes:
        return sse(self._envelope(self.chunk_object, choices))

    def _envelope(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _usage(self, finished: list[m.Finished]) -> dict:
        prompt_tokens = sum(event.prompt_tokens for event in finished[::self.n])
        completion_tokens = sum(event.completion_tokens for event in finished)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}


async def finished_event(events: InvocationEvents, logprobs: LogprobsShaper | None = None) -> m.Finished:
    """Read an invocation to its end; its Finished event (the tokens' logprobs go to `logprobs`)."""
    async for event in events:
        if isinstance(event, m.Token) and logprobs is not None:
            logprobs.add(event.logprobs)
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
