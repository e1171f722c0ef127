"""The OpenAI-compatible API: `model` is the function's name; the official `openai` client works unchanged.

    GET /v1/models, POST /v1/completions, POST /v1/chat/completions (stream as SSE chunks ending with [DONE])
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from lorafaas.errors import InvalidInput, LorafaasError
from lorafaas.function_runtime import messages as m
from lorafaas.function_runtime.messages import MAX_LOGPROBS
from lorafaas.platform.gateway.logprobs import MAX_COMPLETION_LOGPROBS, LogprobsShaper, chat_num_logprobs
from lorafaas.platform.gateway.metrics import GatewayMetrics
from lorafaas.platform.gateway.openapi_docs import SSE, errors
from lorafaas.platform.gateway.schemas import MessageIn, SamplerFields, make_request, seed_field
from lorafaas.platform.gateway.streaming import error_body, sse, start_invocation, usage
from lorafaas.platform.gateway.tools import tools_to_render
from lorafaas.platform.service import FunctionService
from lorafaas.platform.state.records import ApiKeyRecord

OPENAI_RESPONSES: dict[int | str, dict] = {
    200: {"description": "A (chat) completion, or with `stream: true` its chunks as server-sent events ending [DONE]",
          "content": {"application/json": {"schema": {"type": "object"}}, **SSE}},
    **errors(404, 504),
}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _OpenAIBody(SamplerFields):
    model_config = ConfigDict(extra="ignore")  # unknown OpenAI parameters are accepted and ignored
    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: list[str] | str | None = None
    seed: int | None = seed_field()
    n: int = Field(1, ge=1, le=1, description="choices per request: lorafaas returns one")
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_tokens_as_token_ids: bool | None = Field(
        None, description="vLLM's: show logprobs tokens as 'token_id:ID' (tokens that are not text on their own)")

    def limit(self, default: int) -> int:
        if self.n != 1:
            raise InvalidInput(f"n is {self.n}; lorafaas returns one choice per request (n=1)")
        return self.max_completion_tokens or self.max_tokens or default


class ChatBody(_OpenAIBody):
    messages: list[MessageIn] = Field(min_length=1)
    logprobs: bool | None = Field(None, description="return each token's log-probability")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                     description="with logprobs: this many most likely alternatives per token")
    tools: list[dict] | None = Field(None, description="rendered by a chat template that reads them, with "
                                     'tool_choice "none"; otherwise a 400 naming tools (docs/platform.md)')
    tool_choice: str | dict | None = Field(None, description='"none" (or absent without tools)')

    def num_logprobs(self) -> int | None:
        return chat_num_logprobs(self.logprobs, self.top_logprobs)


class CompletionBody(_OpenAIBody):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] = Field(
        description="one prompt (a string, or a list holding one string)")
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS,
                                 description="each token's log-probability and this many most likely alternatives")
    echo: bool | None = Field(None, description="return the prompt before the completion")

    def num_logprobs(self) -> int | None:
        return self.logprobs


def openai_router(service: FunctionService, metrics: GatewayMetrics,
                  caller: Callable[..., ApiKeyRecord]) -> APIRouter:
    router = APIRouter(tags=["openai"])

    async def respond(body: ChatBody | CompletionBody, request, chat: bool, who: ApiKeyRecord,
                      echo: str = "") -> Response:
        """Run the invocation and shape it as a (chat) completion, or as its stream of chunks."""
        events = await start_invocation(service, metrics, who, body.model, request)
        num_logprobs = body.num_logprobs()
        reply = _Reply("chatcmpl" if chat else "cmpl", body.model, chat=chat, service=service,
                       logprobs=None if num_logprobs is None
                       else LogprobsShaper(chat, num_logprobs, bool(body.return_tokens_as_token_ids)),
                       echo=echo)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(reply.stream(events, include_usage), media_type="text/event-stream")
        return JSONResponse(await reply.whole(events))

    @router.get("/v1/models", responses=errors())
    async def models(who: ApiKeyRecord = Depends(caller)) -> dict:
        return {"object": "list", "data": [
            {"id": s.name, "object": "model", "created": int(s.created_at), "owned_by": s.tenant}
            for s in await service.list(who)
        ]}

    @router.post("/v1/chat/completions", responses=OPENAI_RESPONSES)
    async def chat_completions(body: ChatBody, who: ApiKeyRecord = Depends(caller)) -> Response:
        tools = None
        if body.tools or body.tool_choice is not None:
            spec = await service.aget(who, body.model)
            tools = tools_to_render(body.tools, body.tool_choice, spec.backbone, service.models.path(spec.backbone))
        request = make_request(None, body.messages, body.limit(512), body.temperature, body.top_p, body.stop,
                               body.seed, logprobs=body.num_logprobs(), tools=tools, **body.sampler_args())
        return await respond(body, request, chat=True, who=who)

    @router.post("/v1/completions", responses=OPENAI_RESPONSES)
    async def completions(body: CompletionBody, who: ApiKeyRecord = Depends(caller)) -> Response:
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if len(prompts) != 1:
            raise InvalidInput(f"prompt holds {len(prompts)} prompts; send one per request")
        if body.echo and body.logprobs is not None:
            raise InvalidInput("echo with logprobs (the prompt's logprobs) is not supported; leave out one of them")
        request = make_request(prompts[0], None, body.limit(16), body.temperature, body.top_p, body.stop, body.seed,
                               logprobs=body.logprobs, **body.sampler_args())
        return await respond(body, request, chat=False, who=who, echo=prompts[0] if body.echo else "")

    return router


class _Reply:
    """Shapes one invocation's events as an OpenAI (chat) completion or its stream of chunks."""

    def __init__(self, prefix: str, model: str, chat: bool, service: FunctionService,
                 logprobs: LogprobsShaper | None = None, echo: str = "") -> None:
        self.service = service
        self.logprobs = logprobs  # None: the request did not ask for them
        self.echo = echo  # completions: the prompt, shown before the completion
        self.id = f"{prefix}-{secrets.token_hex(12)}"
        self.model = model
        self.chat = chat
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    async def whole(self, events) -> dict:
        async for event in events:
            if isinstance(event, m.Token) and self.logprobs is not None:
                self.logprobs.add(event.logprobs)
            if isinstance(event, m.Finished):
                choice = {"index": 0, "finish_reason": _finish(event), "logprobs": self._take_logprobs()}
                choice |= {"message": {"role": "assistant", "content": event.text}} if self.chat \
                    else {"text": self.echo + event.text}
                return self._envelope(self.object, [choice]) | {"usage": usage(event)}
        raise LorafaasError("the instance ended the request without a result")

    async def stream(self, events, include_usage: bool) -> AsyncIterator[bytes]:
        chunk_object = "chat.completion.chunk" if self.chat else "text_completion"
        if self.chat:
            yield sse(self._envelope(chunk_object, [self._delta({"role": "assistant", "content": ""}, None)]))
        elif self.echo:
            yield sse(self._envelope(chunk_object, [self._delta({}, None, self.echo)]))
        try:
            async for event in events:
                if isinstance(event, m.Token) and self.logprobs is not None:
                    self.logprobs.add(event.logprobs)
                if isinstance(event, m.Token) and event.text:
                    yield sse(self._envelope(chunk_object, [self._delta({"content": event.text}, None, event.text)]))
                elif isinstance(event, m.Finished):
                    yield sse(self._envelope(chunk_object, [self._delta({}, _finish(event), "")]))
                    if include_usage:
                        yield sse(self._envelope(chunk_object, []) | {"usage": usage(event)})
            yield sse("[DONE]")
        except LorafaasError as exc:
            yield sse(error_body(exc, self.service))

    def _delta(self, delta: dict, finish_reason: str | None, text: str = "") -> dict:
        """A chunk's choice, carrying the logprobs of the tokens since the last chunk (a token whose text is held
        back, a partial character or a possible stop string, has its entry in the chunk that shows the text)."""
        logprobs = self._take_logprobs()
        if self.chat:
            return {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
        return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}

    def _take_logprobs(self) -> dict | None:
        return None if self.logprobs is None else self.logprobs.take()

    def _envelope(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}


def _finish(event: m.Finished) -> str:
    return "length" if event.finish_reason == "length" else "stop"
