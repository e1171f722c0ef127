"""The OpenAI-compatible API: `model` is the function's name; the official `openai` client works unchanged.

    GET /v1/models, GET /v1/models/{id}, POST /v1/completions, POST /v1/chat/completions (stream as SSE chunks
    ending with [DONE])

Requests follow OpenAI's and vLLM's protocol (`openai_schemas`); errors are 400s in OpenAI's shape with `param`
(`openai_errors`). `n` samples per prompt and a list of prompts run as one invocation per choice, side by side.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import msgspec
from fastapi import APIRouter, Depends
from fastapi.responses import Response, StreamingResponse

from lorafaas.platform.gateway.max_tokens import max_tokens_for
from lorafaas.platform.gateway.metrics import GatewayMetrics
from lorafaas.platform.gateway.openai_reply import ChoicesReply
from lorafaas.platform.gateway.openai_schemas import ChatBody, CompletionBody, OpenAIBody, Prompt
from lorafaas.platform.gateway.openapi_docs import SSE, errors
from lorafaas.platform.gateway.responses import ChatCompletion, Completion, Model, ModelList, converted, encoded, reply
from lorafaas.platform.gateway.schemas import make_request
from lorafaas.platform.gateway.streaming import InvocationEvents, counted_refusals, start_invocation
from lorafaas.platform.gateway.tools import tools_to_render
from lorafaas.platform.service import FunctionService
from lorafaas.platform.state.records import ApiKeyRecord, ChatMessage, FunctionSpec, InvocationRequest

CHAT_DEFAULT_MAX_TOKENS = 512
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions

CHAT_RESPONSES: dict[int | str, dict] = {
    200: reply(ChatCompletion, "A chat completion, or with `stream: true` its chunks as server-sent events ending "
               "[DONE]", **SSE),
    **errors(400, 404, 504),
}
COMPLETION_RESPONSES: dict[int | str, dict] = {
    200: reply(Completion, "A completion, or with `stream: true` its chunks as server-sent events ending [DONE]",
               **SSE),
    **errors(400, 404, 504),
}


def openai_router(service: FunctionService, metrics: GatewayMetrics,
                  caller: Callable[..., ApiKeyRecord]) -> APIRouter:
    router = APIRouter(tags=["openai"])

    async def respond(body: OpenAIBody, requests: list[InvocationRequest], chat: bool,
                      who: ApiKeyRecord, echoes: list[str] | None = None) -> Response:
        """Start every choice's invocation (a refusal of any is the request's error), then answer with them all. Each
        prompt is charged once, to its first sample, as the reply's usage counts it."""
        n = body.n or 1
        started = await asyncio.gather(*(start_invocation(service, metrics, who, body.model, request,
                                                          charge_prompt=index % n == 0)
                                         for index, request in enumerate(requests)), return_exceptions=True)
        failures = [outcome for outcome in started if isinstance(outcome, BaseException)]
        if failures:
            await asyncio.gather(*(outcome.rest.aclose() for outcome in started
                                   if isinstance(outcome, InvocationEvents)))
            raise failures[0]
        choices = [outcome for outcome in started if isinstance(outcome, InvocationEvents)]  # (all of them now)
        num_logprobs = body.num_logprobs()
        answer = ChoicesReply(body.model, chat, service, n=n, echoes=echoes,
                             logprobs=None if num_logprobs is None
                             else (num_logprobs, bool(body.return_tokens_as_token_ids)))
        if body.stream:
            return StreamingResponse(answer.stream(choices, body.include_usage), media_type="text/event-stream")
        return converted(await answer.whole(choices), ChatCompletion if chat else Completion)

    @router.get("/v1/models", response_model=None,
                responses={200: reply(ModelList, "The caller's functions as models"), **errors()})
    async def models(who: ApiKeyRecord = Depends(caller)) -> Response:
        return encoded(ModelList(object="list", data=[_model(spec) for spec in await service.list(who)]))

    @router.get("/v1/models/{name}", response_model=None,
                responses={200: reply(Model, "The function as a model"), **errors(404)})
    async def model(name: str, who: ApiKeyRecord = Depends(caller)) -> Response:
        return encoded(_model(await service.aget(who, name)))

    @router.post("/v1/chat/completions", responses=CHAT_RESPONSES)
    async def chat_completions(body: ChatBody, who: ApiKeyRecord = Depends(caller)) -> Response:
        body.check()
        messages = body.records()
        with counted_refusals(metrics, body.model):
            spec = await service.aget(who, body.model)
            tools = None
            if body.tools or body.tool_choice is not None:
                tools = tools_to_render(body.tools_as_sent(), body.tool_choice, spec.backbone,
                                        service.models.path(spec.backbone))
            requested, param = body.requested_max_tokens()
            max_tokens = await max_tokens_for(service, spec, requested, CHAT_DEFAULT_MAX_TOKENS, param)
            requests = _choices(body, spec, [messages], max_tokens, requested is not None, tools)
        return await respond(body, requests, chat=True, who=who)

    @router.post("/v1/completions", responses=COMPLETION_RESPONSES)
    async def completions(body: CompletionBody, who: ApiKeyRecord = Depends(caller)) -> Response:
        prompts = body.prompts()
        body.check(num_prompts=len(prompts))
        with counted_refusals(metrics, body.model):
            echoes = [body.echoed(prompt) for prompt in prompts for _ in range(body.n or 1)]  # refused before any I/O
            spec = await service.aget(who, body.model)
            max_tokens = await max_tokens_for(service, spec, body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS)
            requests = _choices(body, spec, prompts, max_tokens, body.max_tokens is not None)
        return await respond(body, requests, chat=False, who=who, echoes=echoes)

    return router


def _choices(body: OpenAIBody, spec: FunctionSpec, prompts: Sequence[Prompt | list[ChatMessage]],
             max_tokens: int, exact: bool, tools: str | None = None) -> list[InvocationRequest]:
    """One invocation per choice, prompt by prompt; sample i of a seeded request uses seed + i (as vLLM's)."""
    requests = []
    for prompt in prompts:
        # Checked once per prompt (a response_format schema is compiled by the check); its samples differ only in
        # the seed, which body.check bounded for all n of them.
        request = _request(body, prompt, max_tokens, exact, tools).check(spec.max_tokens_limit)
        for i in range(body.n or 1):
            seed = body.seed + i if body.seed is not None else None
            requests.append(msgspec.structs.replace(request, seed=seed))
    return requests


def _request(body: OpenAIBody, prompt: Prompt | list[ChatMessage], max_tokens: int, exact: bool,
             tools: str | None = None) -> InvocationRequest:
    text = prompt if isinstance(prompt, str) else None
    messages = prompt if text is None and isinstance(prompt[0], ChatMessage) else None
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    request = make_request(text, messages, max_tokens, temperature, top_p, body.stop, body.seed,
                           logprobs=body.num_logprobs(), tools=tools, max_tokens_exact=exact, **body.sampler_args())
    token_ids = list(prompt) if text is None and messages is None else None
    return msgspec.structs.replace(request, prompt_token_ids=token_ids, ignore_eos=bool(body.ignore_eos))


def _model(spec: FunctionSpec) -> Model:
    return Model(id=spec.name, object="model", created=int(spec.created_at), owned_by=spec.tenant)

