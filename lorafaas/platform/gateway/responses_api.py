"""POST /v1/responses: OpenAI's Responses API, text in and text out, whole or streamed.

The input (a string, or a list of messages) and `instructions` (a system message first) go through the function's
chat template as a chat completion's messages do; the reply is one `message` output item holding one `output_text`
part. lorafaas keeps no responses: `store` is accepted only as false (or absent), and `previous_response_id`,
tools, reasoning and non-text formats are refused with 400 naming them (the `openai` SDK's
`client.responses.create(...)` and its `output_text` work unchanged).

A stream sends OpenAI's event sequence: response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta ..., response.output_text.done, response.content_part.done,
response.output_item.done, response.completed; an error after the headers is an `error` event.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Literal

from fastapi import APIRouter, Depends
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from lorafaas.errors import LorafaasError, ServerError
from lorafaas.function_runtime import messages as m
from lorafaas.platform.gateway.max_tokens import max_tokens_for
from lorafaas.platform.gateway.metrics import GatewayMetrics
from lorafaas.platform.gateway.openai_reply import finished_event
from lorafaas.platform.gateway.openai_schemas import refuse_unsupported
from lorafaas.platform.gateway.openapi_docs import SSE, errors
from lorafaas.platform.gateway.responses import ResponseObject, converted, reply
from lorafaas.platform.gateway.schemas import NoBoolNumbers, make_request
from lorafaas.platform.gateway.streaming import InvocationEvents, counted_refusals, error_body, sse, start_invocation
from lorafaas.platform.service import FunctionService
from lorafaas.platform.state.records import ApiKeyRecord, ChatMessage

DEFAULT_MAX_OUTPUT_TOKENS = 512  # as chat completions

# Defined by the Responses API, not implemented: accepted only at the value that turns them off (null always does).
_OFF_VALUES: dict[str, tuple] = {
    "store": (False,), "previous_response_id": (), "tools": ([],), "tool_choice": ("none",),
    "parallel_tool_calls": (False,), "reasoning": (), "include": ([],), "metadata": ({},), "truncation": ("disabled",),
    "background": (False,), "top_logprobs": (0,), "max_tool_calls": (), "prompt": (), "service_tier": (),
    "prompt_cache_key": (), "safety_identifier": (), "conversation": (), "stream_options": (),
    "text": ({"format": {"type": "text"}},),
}

RESPONSES_RESPONSES: dict[int | str, dict] = {
    200: reply(ResponseObject, "A response object, or with `stream: true` its events as server-sent events", **SSE),
    **errors(400, 404, 504),
}


class InputText(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def to_record(self) -> ChatMessage:
        text = self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)
        return ChatMessage(role="system" if self.role == "developer" else self.role, content=text)


class ResponsesBody(NoBoolNumbers):
    # Fields beyond these are read (refuse_unsupported), not ignored.
    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False})
    model: str
    input: str | Annotated[list[InputMessage], Field(min_length=1)] = Field(
        description="a string (one user turn) or a list of messages")
    instructions: str | None = Field(None, description="a system message before the input")
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: StrictBool | None = None
    user: str | None = Field(None, description="the caller's own end-user label; no effect on output")

    def messages(self) -> list[ChatMessage]:
        refuse_unsupported(self.model_extra, off_values=_OFF_VALUES)
        turns = [ChatMessage(role="user", content=self.input)] if isinstance(self.input, str) \
            else [message.to_record() for message in self.input]
        return ([ChatMessage(role="system", content=self.instructions)] if self.instructions else []) + turns


def responses_router(service: FunctionService, metrics: GatewayMetrics,
                     caller: Callable[..., ApiKeyRecord]) -> APIRouter:
    router = APIRouter(tags=["openai"])

    @router.post("/v1/responses", responses=RESPONSES_RESPONSES)
    async def responses(body: ResponsesBody, who: ApiKeyRecord = Depends(caller)) -> Response:
        messages = body.messages()
        with counted_refusals(metrics, body.model):
            spec = await service.aget(who, body.model)
            max_tokens = await max_tokens_for(service, spec, body.max_output_tokens, DEFAULT_MAX_OUTPUT_TOKENS,
                                              "max_output_tokens")
            request = make_request(None, messages, max_tokens, 1.0 if body.temperature is None else body.temperature,
                                   1.0 if body.top_p is None else body.top_p, None, None,
                                   max_tokens_exact=body.max_output_tokens is not None).check(spec.max_tokens_limit)
        events = await start_invocation(service, metrics, who, body.model, request)
        answer = _Response(body, max_tokens, service)
        if body.stream:
            return StreamingResponse(answer.stream(events), media_type="text/event-stream")
        return converted(await answer.whole(events), ResponseObject)

    return router


class _Response:
    """One response object, built whole or as the stream of events that builds it."""

    def __init__(self, body: ResponsesBody, max_tokens: int, service: FunctionService) -> None:
        self.body, self.max_tokens, self.service = body, max_tokens, service
        self.id = f"resp_{secrets.token_hex(12)}"
        self.item_id = f"msg_{secrets.token_hex(12)}"
        self.created_at = int(time.time())
        self._sequence = 0

    async def whole(self, events: InvocationEvents) -> dict:
        return self._object(await finished_event(events))

    async def stream(self, events: InvocationEvents) -> AsyncIterator[bytes]:
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        try:
            yield self._event("response.created", response=self._object(None))
            yield self._event("response.in_progress", response=self._object(None))
            yield self._event("response.output_item.added", output_index=0, item=self._item("", "in_progress"))
            yield self._event("response.content_part.added", **where, part=_text_part(""))
            async for event in events:
                if isinstance(event, m.Token) and event.text:
                    yield self._event("response.output_text.delta", **where, delta=event.text, logprobs=[])
                elif isinstance(event, m.Finished):
                    yield self._event("response.output_text.done", **where, text=event.text, logprobs=[])
                    yield self._event("response.content_part.done", **where, part=_text_part(event.text))
                    yield self._event("response.output_item.done", output_index=0,
                                      item=self._item(event.text, "completed"))
                    yield self._event("response.completed", response=self._object(event))
                    return
            raise ServerError("the instance ended the request without a result")
        except LorafaasError as exc:  # the headers are sent: the error travels as the last event
            error = error_body(exc, self.service)["error"]
            yield self._event("error", code=error["code"], message=error["message"], param=None)

    def _event(self, kind: str, **fields) -> bytes:
        self._sequence += 1
        return sse({"type": kind, "sequence_number": self._sequence - 1, **fields}, event=kind)

    def _item(self, text: str, status: str) -> dict:
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant",
                "content": [_text_part(text)] if status == "completed" else []}

    def _object(self, finished: m.Finished | None) -> dict:
        """The response: in progress (no output yet) until `finished`."""
        incomplete = finished is not None and finished.finish_reason == "length"
        status = "in_progress" if finished is None else "incomplete" if incomplete else "completed"
        body = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions, "max_output_tokens": self.max_tokens, "model": body.model,
            "output": [] if finished is None else [self._item(finished.text, "completed")],
            "parallel_tool_calls": False, "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p, "tool_choice": "none", "tools": [],
            "text": {"format": {"type": "text"}}, "store": False, "metadata": {}, "user": body.user,
            "usage": None if finished is None else {
                "input_tokens": finished.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": finished.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": finished.prompt_tokens + finished.completion_tokens},
        }


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}
