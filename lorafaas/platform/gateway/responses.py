"""What every route answers with a 2xx, as msgspec structs: the routes build these (or convert what they build to
them) and encode them, and /openapi.json describes them (`reply` names a struct as a route's 2xx body, `install`
adds the structs' schemas to the document's components). The JSON is what the routes always answered: field names,
shapes and (for the OpenAI routes) vLLM's. Streams (SSE), /metrics and logs are text and documented as such
(`openapi_docs`).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from fastapi import FastAPI
from fastapi.responses import Response

from lorafaas.platform.auth import KeyInfo
from lorafaas.platform.batches import BatchDeployed
from lorafaas.platform.descriptions import FunctionDescription
from lorafaas.platform.gateway.logprobs import ChatLogprobs, CompletionLogprobs
from lorafaas.platform.service import UsageReport
from lorafaas.platform.state.records import FunctionSpec, InvocationRecord

# -- native routes ------------------------------------------------------------------------------------------------


class Status(msgspec.Struct, kw_only=True):
    status: str  # "ok" (/healthz), "ready" or "starting" (/readyz)


class FunctionList(msgspec.Struct, kw_only=True):
    functions: list[FunctionSpec]


class Deleted(msgspec.Struct, kw_only=True):
    deleted: str  # the function's name


class InvocationList(msgspec.Struct, kw_only=True):
    invocations: list[InvocationRecord]


class Accepted(msgspec.Struct, kw_only=True):
    """An asynchronous invoke's 202: poll `location`."""

    invocation_id: str
    status: str
    location: str


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Timings(msgspec.Struct, kw_only=True):
    ttft_s: float
    e2e_s: float


class InvokeResult(msgspec.Struct, kw_only=True):
    """A synchronous invoke's result (with `stream: true`, SSE `token` events then `done`)."""

    function: str
    invocation_id: str
    text: str
    finish_reason: str
    usage: Usage
    timings: Timings


class KeyCreated(msgspec.Struct, kw_only=True):
    tenant: str
    key_id: str
    key: str  # shown once


class KeyList(msgspec.Struct, kw_only=True):
    keys: list[KeyInfo]


class KeyRevoked(msgspec.Struct, kw_only=True):
    revoked: str  # the key's id
    tenant: str


# -- OpenAI routes: vLLM's shapes ---------------------------------------------------------------------------------


class Model(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(msgspec.Struct, kw_only=True):
    object: Literal["list"]
    data: list[Model]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    finish_reason: str
    logprobs: CompletionLogprobs | None
    text: str


class Completion(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: Literal["assistant"]
    content: str


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    finish_reason: str
    logprobs: ChatLogprobs | None
    message: AssistantMessage


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class OutputText(msgspec.Struct, kw_only=True):
    type: Literal["output_text"]
    text: str
    annotations: tuple[()]  # lorafaas makes none (OpenAI's are citations)


class OutputMessage(msgspec.Struct, kw_only=True):
    type: Literal["message"]
    id: str
    status: str
    role: Literal["assistant"]
    content: list[OutputText]


class IncompleteDetails(msgspec.Struct, kw_only=True):
    reason: str


class TextFormat(msgspec.Struct, kw_only=True):
    type: Literal["text"]


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat


class InputTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseObject(msgspec.Struct, kw_only=True):
    """A Responses API response object (POST /v1/responses)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: str  # completed, incomplete, or in_progress (in a stream's first events)
    error: None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int
    model: str
    output: list[OutputMessage]
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    tool_choice: str
    tools: tuple[()]  # a request with tools is refused (responses_api.py)
    text: TextConfig
    store: bool
    metadata: dict[str, str]
    user: str | None
    usage: ResponseUsage | None


STRUCTS: tuple[type, ...] = (Status, FunctionSpec, FunctionList, BatchDeployed, FunctionDescription, Deleted,
                             InvokeResult, Accepted, InvocationRecord, InvocationList, UsageReport, KeyCreated, KeyList,
                             KeyRevoked, Model, ModelList, Completion, ChatCompletion, ResponseObject)
_REF = "#/components/schemas/{name}"


def reply(struct: type, description: str, **extra_content: dict) -> dict[str, Any]:
    """An OpenAPI response whose JSON body is `struct` (one of STRUCTS), with more media types if given."""
    if struct not in STRUCTS:
        raise ValueError(f"{struct.__name__} is not in responses.STRUCTS, so its schema is not in the document")
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": _REF.format(name=struct.__name__)}}, **extra_content}}


def encoded(value: msgspec.Struct, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    """The struct as the JSON response."""
    return Response(msgspec.json.encode(value), status_code=status_code, headers=headers,
                    media_type="application/json")


def converted(value: dict[str, Any], struct: type) -> Response:
    """A reply built as a dict (the OpenAI replies, shaped field by field) checked against its struct and encoded."""
    return encoded(msgspec.convert(value, struct))


def install(app: FastAPI) -> None:
    """Add STRUCTS' schemas (and those they refer to) to /openapi.json's components."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = build()
        _, components = msgspec.json.schema_components(STRUCTS, ref_template=_REF)
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        clash = set(components) & set(schemas)
        if clash:
            raise ValueError(f"response structs named as request models: {sorted(clash)}")
        schemas.update(components)
        for operation in (op for methods in document["paths"].values() for op in methods.values()):
            for status, response in operation["responses"].items():
                content = response.get("content", {})
                # A route answering text (/metrics, logs) gets FastAPI's default JSON media type too, schema-less
                if status.startswith("2") and content.get("application/json") == {"schema": {}}:
                    del content["application/json"]
        return document

    app.openapi = openapi  # type: ignore[method-assign]
