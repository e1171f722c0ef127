"""Request bodies of the OpenAI-compatible routes, as OpenAI and vLLM (`entrypoints/openai/protocol.py`) define them.

`null` for an optional field means its default. A parameter OpenAI or vLLM defines that lorafaas does not implement
is accepted only at the value that turns it off (`best_of: 1`, `use_beam_search: false`, ...); any other value, and
any field neither defines, is a 400 naming it (`param`): nothing a caller sends is ignored silently.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from lorafaas.function_runtime.messages import MAX_LOGPROBS, ToolCall, ToolCallFunction
from lorafaas.platform.gateway.logprobs import MAX_COMPLETION_LOGPROBS
from lorafaas.platform.gateway.openai_errors import InvalidParameter
from lorafaas.platform.gateway.schemas import SamplerFields, seed_field
from lorafaas.platform.state.records import MAX_SEED, ChatMessage

MAX_CHOICES = 32  # prompts x n in one request: each choice is one generation

# Defined by OpenAI or vLLM, not implemented by lorafaas: the values that mean "not used" (null always does).
_OFF_VALUES: dict[str, tuple] = {
    "suffix": ("",), "best_of": (1,),

    "length_penalty": (1,),
    "parallel_tool_calls": (), "functions": ([],), "function_call": ("none",),
    "use_beam_search": (False,), "min_tokens": (0,), "stop_token_ids": ([],), "bad_words": ([],),
    "allowed_token_ids": (), "include_stop_str_in_output": (False,), "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,), "prompt_logprobs": (), "truncate_prompt_tokens": (),
    "add_generation_prompt": (True,), "continue_final_message": (False,), "include_reasoning": (True,),
    "documents": (), "chat_template": (), "chat_template_kwargs": ({},), "mm_processor_kwargs": ({},),
    "structured_outputs": (), "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "guided_decoding_backend": (), "guided_whitespace_pattern": (), "logits_processors": (), "prompt_embeds": (),
    "return_token_ids": (False,), "priority": (0,), "cache_salt": (),
    "kv_transfer_params": (), "vllm_xargs": (), "request_id": (), "reasoning_effort": (), "modalities": (["text"],),
    "audio": (), "prediction": (), "web_search_options": (), "metadata": (), "store": (False,), "service_tier": (),
    "verbosity": (), "prompt_cache_key": (), "safety_identifier": (),
}
_STREAM_OPTIONS_OFF_VALUES: dict[str, tuple] = {"continuous_usage_stats": (False,), "include_obfuscation": ()}
# Carried by OpenAI's own response objects (so clients send them back in the history): null only.
_MESSAGE_NULL_FIELDS = ("refusal", "annotations", "audio", "function_call", "reasoning_content", "reasoning")


def refuse_unsupported(extra: dict | None, where: str = "", off_values: dict[str, tuple] = _OFF_VALUES) -> None:
    for name, value in (extra or {}).items():
        param = f"{where}{name}"
        if name not in off_values:
            raise InvalidParameter(param, f"{param} is not a parameter of this endpoint")
        if value is not None and not any(_same(value, off) for off in off_values[name]):
            raise InvalidParameter(param, f"{param} is not supported by lorafaas; leave it out (or send null)")


def _same(value, off) -> bool:
    numeric = (int, float)
    if isinstance(off, numeric) and not isinstance(off, bool):
        return isinstance(value, numeric) and not isinstance(value, bool) and value == off
    return type(value) is type(off) and value == off


# Fields beyond the declared ones are read (refuse_unsupported), not ignored: the schema says they are not accepted.
_CHECKED_EXTRAS = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False})


def _given(field: str, schema: dict) -> dict:
    """JSON Schema condition: `field` is present and not null (null means absent here) and matches `schema`."""
    return {"required": [field], "properties": {field: schema}}


# The rules between fields that check() and the bodies' methods enforce (each a 400 naming its param), stated in
# /openapi.json as if/then so a request the schema allows is one the server takes.
_STREAM_OPTIONS_NEED_STREAM = {"if": _given("stream_options", {"type": "object"}),
                               "then": _given("stream", {"const": True})}
_TOP_LOGPROBS_NEED_LOGPROBS = {"if": _given("top_logprobs", {"type": "integer"}),
                               "then": _given("logprobs", {"const": True})}
_ECHO_OF_TEXT_WITHOUT_LOGPROBS = {
    "if": _given("echo", {"const": True}),
    "then": {"properties": {"logprobs": {"type": "null"},
                            "prompt": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}}},
}


def _checked_extras(*rules: dict) -> ConfigDict:
    return ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False, "allOf": list(rules)})


class StreamOptions(BaseModel):
    model_config = _CHECKED_EXTRAS
    include_usage: StrictBool | None = None


class FunctionCallIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class FunctionDefinitionIn(BaseModel):
    """A tool's function (OpenAI's `FunctionDefinition`, vLLM's): what the chat template renders."""

    model_config = ConfigDict(extra="forbid")
    name: str
    description: str | None = None
    # A JSON Schema of the function's arguments: arbitrary JSON by definition, so a free-form mapping, passed to the
    # chat template as sent.
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolIn(BaseModel):
    """One of chat's `tools` (OpenAI's `ChatCompletionFunctionToolParam`): a function tool, the only kind."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: FunctionDefinitionIn


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    model_config = _CHECKED_EXTRAS
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallIn] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content):
        """Named here, before pydantic tries each member of the union and reports them all."""
        for i, part in enumerate(content if isinstance(content, list) else ()):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ValueError(f"content part {i} is {str(part)[:80]}; lorafaas serves text models and takes "
                                 "only text parts ({'type': 'text', 'text': '...'})")
        return content

    def to_record(self, index: int) -> ChatMessage:
        where = f"messages[{index}]"
        for name, value in (self.model_extra or {}).items():
            if name not in _MESSAGE_NULL_FIELDS:
                raise InvalidParameter(f"{where}.{name}", f"{where}.{name} is not a field of a chat message")
            if value is not None:
                raise InvalidParameter(f"{where}.{name}", f"{where}.{name} is not supported by lorafaas")
        # As vLLM renders text for a chat template: parts joined by newlines, null content as empty text; the
        # template gets tool_calls, tool_call_id and name as sent, and decides what they mean.
        content = "\n".join(p.text for p in self.content) if isinstance(self.content, list) else self.content or ""
        calls = [ToolCall(id=call.id, type=call.type, function=ToolCallFunction(
            name=call.function.name, arguments=call.function.arguments)) for call in self.tool_calls or ()]
        return ChatMessage(role="system" if self.role == "developer" else self.role, content=content,
                           tool_call_id=self.tool_call_id, tool_calls=calls if self.tool_calls is not None else None,
                           name=self.name)


class OpenAIBody(SamplerFields):
    model_config = _checked_extras(_STREAM_OPTIONS_NEED_STREAM)
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: list[str] | str | None = None
    seed: int | None = seed_field()
    n: int | None = Field(None, ge=1, le=MAX_CHOICES, description="choices per prompt")
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool | None = Field(None, description="vLLM's extension: generate max_tokens, past the EOS token")
    user: str | None = Field(None, description="an end-user label for the caller's own tracking; no effect on output")
    return_tokens_as_token_ids: StrictBool | None = Field(
        None, description="vLLM's: show logprobs tokens as 'token_id:ID' (tokens that are not text on their own)")

    # vLLM tokenizes a chat prompt without special tokens (the template has them) and a completion prompt with them.
    special_tokens_added: ClassVar[bool]
    # Defined by vLLM for this endpoint, not implemented by lorafaas: their off values.
    endpoint_off_values: ClassVar[dict[str, tuple]] = {}

    def check(self, num_prompts: int = 1) -> None:
        off_values = _OFF_VALUES | self.endpoint_off_values | {"add_special_tokens": (self.special_tokens_added,)}
        refuse_unsupported(self.model_extra, off_values=off_values)
        if self.stream_options is not None:
            if not self.stream:
                raise InvalidParameter("stream_options", "stream_options needs stream: true")
            refuse_unsupported(self.stream_options.model_extra, "stream_options.", _STREAM_OPTIONS_OFF_VALUES)
        n = self.n or 1
        if num_prompts * n > MAX_CHOICES:
            raise InvalidParameter("n", f"{num_prompts} prompt(s) x n={n} make {num_prompts * n} choices; at most "
                                        f"{MAX_CHOICES} per request")
        if self.seed is not None and self.seed + n - 1 > MAX_SEED:  # choice i samples with seed + i
            raise InvalidParameter("seed", f"seed is {self.seed}; with n={n} it must be at most {MAX_SEED - n + 1}")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def num_logprobs(self) -> int | None:
        """Alternatives per token to return (0: the chosen token's only), or None: no logprobs. Per endpoint."""
        raise NotImplementedError


class ChatBody(OpenAIBody):
    model_config = _checked_extras(_STREAM_OPTIONS_NEED_STREAM, _TOP_LOGPROBS_NEED_LOGPROBS)
    special_tokens_added: ClassVar[bool] = False
    # vLLM's chat `echo` prepends the last message's content when it is the reply's role (assistant)
    endpoint_off_values: ClassVar[dict[str, tuple]] = {"echo": (False,)}
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[ToolIn] | None = Field(None, description="rendered by a chat template that reads them, with "
                                       'tool_choice "none"; otherwise a 400 naming tools (docs/platform.md)')
    tool_choice: str | dict | None = Field(None, description='"none" (or absent without tools)')
    logprobs: StrictBool | None = Field(None, description="return each token's log-probability")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                     description="with logprobs: this many most likely alternatives per token")

    def num_logprobs(self) -> int | None:
        """The alternatives per token asked for; None: no logprobs."""
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameter("top_logprobs", "top_logprobs is set but logprobs is not true; set logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def tools_as_sent(self) -> list[dict[str, Any]] | None:
        """The tools for the chat template: the fields the request gave, nothing defaulted in."""
        return None if self.tools is None else [tool.model_dump(exclude_unset=True) for tool in self.tools]

    def records(self) -> list[ChatMessage]:
        return [message.to_record(i) for i, message in enumerate(self.messages)]


Prompt = str | list[int]
T = TypeVar("T")
NonEmpty = Annotated[T, Field(min_length=1)]
TokenIds = Annotated[list[int], Field(min_length=1)]


class CompletionBody(OpenAIBody):
    model_config = _checked_extras(_STREAM_OPTIONS_NEED_STREAM, _ECHO_OF_TEXT_WITHOUT_LOGPROBS)
    special_tokens_added: ClassVar[bool] = True
    max_tokens: int | None = Field(None, ge=1, description="16 when omitted (as OpenAI and vLLM)")
    prompt: str | NonEmpty[list[str]] | TokenIds | NonEmpty[list[TokenIds]] = Field(
        description="a prompt, a list of prompts, a prompt of token ids, or a list of them")
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS,
                                 description="each token's log-probability and this many most likely alternatives")
    echo: StrictBool | None = Field(None, description="return the prompt (text prompts) before the completion")

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def echoed(self, prompt: Prompt) -> str:
        """What `echo` shows before a choice's completion."""
        if not self.echo:
            return ""
        if self.logprobs is not None:
            raise InvalidParameter("echo", "echo with logprobs (the prompt's logprobs) is not supported; leave out "
                                           "one of them")
        if not isinstance(prompt, str):
            raise InvalidParameter("echo", "echo is supported for text prompts, not token-id prompts")
        return prompt

    @field_validator("prompt", mode="before")
    @classmethod
    def _no_empty_lists(cls, prompt):
        if prompt == []:
            raise ValueError("prompt is an empty list; give a prompt")
        for i, one in enumerate(prompt if isinstance(prompt, list) else ()):
            if one == []:
                raise ValueError(f"prompt[{i}] holds no token ids; give at least one")
        return prompt

    def prompts(self) -> list[Prompt]:
        prompt = self.prompt
        return [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else list(prompt)
