"""Request bodies at the HTTP edge (pydantic), converted at once into the internal records."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationInfo, field_validator

from lorafaas.errors import InvalidInput
from lorafaas.formats.model_store import NAME_PATTERN
from lorafaas.function_runtime.grammar import SchemaRefused
from lorafaas.platform.state.records import (
    MAX_INSTANCES,
    MAX_KEEP_ALIVE_S,
    MAX_REQUEST_S,
    MAX_SEED,
    MAX_SLO_TTFT_MS,
    MAX_TOKENS_LIMIT,
    MIN_SEED,
    ChatMessage,
    InvocationRequest,
    ResponseFormat,
)

INVOKE_DEFAULT_MAX_TOKENS = 128
# A logit_bias key: a token id as JSON object keys carry it (vLLM and OpenAI take these; the vocabulary bounds it).
TOKEN_ID_KEY = re.compile(r"^(0|[1-9][0-9]{0,9})$")

# The same bounds the records check (InvocationRequest.check, FunctionSpec.check), stated here so /openapi.json
# shows them; a value outside them is a 422 naming the field either way.
def seed_field():
    return Field(None, ge=MIN_SEED, le=MAX_SEED,
                 description="an integer within +-(2^53 - 1); the same seed gives the same sample")



class JsonSchemaIn(BaseModel):
    """response_format.json_schema (OpenAI's): the schema the output must match."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$", description="the schema's name (OpenAI requires one)")
    description: str | None = None
    # A JSON Schema is arbitrary JSON by definition: a free-form mapping here, checked when it is compiled.
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="a JSON Schema")
    strict: StrictBool | None = Field(None, description="accepted either way: lorafaas always enforces the schema "
                                      "exactly")


class ResponseFormatIn(BaseModel):
    """OpenAI's response_format: `text` (free), `json_object` (any JSON object) or `json_schema`."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaIn | None = None

    def to_record(self) -> ResponseFormat:
        if self.type != "json_schema":
            if self.json_schema is not None:
                raise SchemaRefused(f"response_format.json_schema is given with type {self.type}; use type json_schema")
            return ResponseFormat(type=self.type)
        if self.json_schema is None:
            raise SchemaRefused("response_format.json_schema is required with type json_schema")
        schema = self.json_schema
        return ResponseFormat(type="json_schema", name=schema.name, strict=schema.strict,
                              schema=None if schema.schema_ is None else json.dumps(schema.schema_))


class NoBoolNumbers(BaseModel):
    """Its number fields (and a mapping's numbers) refuse booleans: pydantic's lax int and float read false as 0, the
    schema says number (and schemathesis's negative data sends them)."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        annotation = str(cls.model_fields[info.field_name].annotation) if info.field_name is not None else "bool"
        if "bool" in annotation:
            return value
        # a mapping of numbers (logit_bias) too; a nested model (stream_options, response_format) checks its own
        values = value.values() if isinstance(value, dict) and "dict[" in annotation else (value,)
        if any(isinstance(v, bool) for v in values):
            raise ValueError("a boolean is not a valid value here")
        return value


class SamplerFields(NoBoolNumbers):
    """vLLM's sampling parameters beyond temperature/top_p/seed (null or absent: off), and structured output
    (response_format). Their semantics are vLLM's; see `lorafaas.function_runtime.sampling.next_token` and
    docs/platform.md."""

    top_k: int | None = Field(None, ge=-1, description="sample from the k most likely tokens; -1 or 0: off")
    min_p: float | None = Field(None, ge=0.0, le=1.0,
                                description="drop tokens less likely than min_p x the most likely one; 0: off")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0,
                                           description="subtracted from the logit of every token already generated")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0,
                                            description="subtracted per time a token was already generated")
    repetition_penalty: float | None = Field(
        None, gt=0.0, le=100.0, description="divides the positive (multiplies the negative) logits of tokens in "
        "the prompt or the output; 1: off")
    logit_bias: Annotated[dict[int, Annotated[float, Field(ge=-100.0, le=100.0)]],
                          Field(json_schema_extra={"propertyNames": {"pattern": TOKEN_ID_KEY.pattern}})] | None = Field(
        None, description="token id (a string of decimal digits in JSON) -> a bias between -100 and 100 added to its "
                          "logit")
    response_format: ResponseFormatIn | None = Field(
        None, description="constrain the output: {type: text | json_object | json_schema, json_schema: {name, schema, "
        "strict}}; the output then parses as JSON matching the schema unless max_tokens cut it (finish_reason length)")

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _token_id_keys(cls, logit_bias):
        """Keys exactly as the schema's propertyNames says: pydantic alone would also read "+1", " 1" or "1_0"."""
        for key in logit_bias if isinstance(logit_bias, dict) else ():
            if not (isinstance(key, str) and TOKEN_ID_KEY.fullmatch(key)):
                raise ValueError(f"key {str(key)[:40]!r} is not a token id (decimal digits, no sign or leading zero)")
        return logit_bias

    def sampler_args(self) -> dict:
        """The fields given, as InvocationRequest keyword arguments."""
        args = {name: getattr(self, name) for name in SamplerFields.model_fields if getattr(self, name) is not None}
        if self.response_format is not None:
            args["response_format"] = self.response_format.to_record()
        return args


class MessageIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str = Field(pattern="^(system|user|assistant)$")
    content: str


class InvokeBody(SamplerFields):
    """POST /v1/functions/{name}/invoke"""

    model_config = ConfigDict(extra="forbid")
    prompt: str | None = None
    messages: list[MessageIn] | None = Field(None, min_length=1)
    max_tokens: int | None = Field(
        None, ge=1, le=MAX_TOKENS_LIMIT,
        description=f"at most the function's max_tokens_limit; omitted: {INVOKE_DEFAULT_MAX_TOKENS}, or less where "
                    "the function's limit or the room left in the context is smaller")
    temperature: float = Field(0.0, ge=0.0, le=2.0)  # greedy by default: the same prompt gives the same answer
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: list[str] | str | None = None
    seed: int | None = seed_field()
    stream: StrictBool = False

    def to_request(self, max_tokens: int) -> InvocationRequest:
        """The request, generating `max_tokens` (this body's, checked against the function, or its default)."""
        return make_request(self.prompt, self.messages, max_tokens, self.temperature, self.top_p, self.stop,
                            self.seed, max_tokens_exact=self.max_tokens is not None, **self.sampler_args())


class DeploySpec(BaseModel):
    """The `spec` form field of POST /v1/functions (and, partially, of PATCH)."""

    model_config = ConfigDict(extra="forbid")
    name: str | None = None
    backbone: str | None = None
    tenant: str | None = None  # admin only: deploy on behalf of a tenant
    slo_ttft_ms: int | None = Field(None, ge=1, le=MAX_SLO_TTFT_MS)
    keep_alive_s: float | None = Field(None, ge=0, le=MAX_KEEP_ALIVE_S)
    min_instances: int | None = Field(None, ge=0, le=MAX_INSTANCES)
    max_instances: int | None = Field(None, ge=1, le=MAX_INSTANCES)
    max_tokens_limit: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_request_s: float | None = Field(None, ge=0.1, le=MAX_REQUEST_S)
    lora_mode: str | None = Field(None, description="MoE backbones only: remote (the default) or local")
    shared_base: StrictBool | None = Field(None, description="Whether its steps may join the node's shared base pass "
                                     "(true, the default, where the node runs one); false: never")


class KeyBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant: str = Field(pattern=NAME_PATTERN.pattern, description="1-63 lowercase letters, digits and '-'")


def make_request(prompt, messages, max_tokens, temperature, top_p, stop, seed, **sampling) -> InvocationRequest:
    """`sampling`: further InvocationRequest fields (top_k, penalties, logit_bias, logprobs)."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    texts = {"prompt": prompt} | {f"stop[{i}]": text for i, text in enumerate(stops)}
    texts |= {f"messages[{i}].content": msg.content for i, msg in enumerate(messages or ())}
    for field_name, text in texts.items():
        _check_encodable(field_name, text)
    return InvocationRequest(
        prompt=prompt,
        messages=[msg if isinstance(msg, ChatMessage) else ChatMessage(role=msg.role, content=msg.content)
                  for msg in messages] if messages is not None else None,
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=stops, seed=seed, **sampling,
    )


def _check_encodable(field_name: str, text: str | None) -> None:
    """JSON may escape a lone surrogate (\\ud800) that no UTF-8 tokenizer or wire message can carry: refuse it here."""
    if text is None:
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInput(
            f"{field_name} holds a lone UTF-16 surrogate ({text[exc.start]!r} at character {exc.start}); "
            "send valid Unicode text"
        ) from None
