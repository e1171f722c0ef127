"""What the state store keeps: deployed functions, invocations, API keys. Data only, stored as msgspec JSON.

Records are frozen; an update is a new record (`msgspec.structs.replace`) written back whole. Decoding ignores
fields it does not know, so a newer writer's records stay readable by an older reader.
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import Literal

import msgspec

from lorafaas.errors import InvalidInput
from lorafaas.formats.model_store import check_name
from lorafaas.function_runtime.grammar import JSON_OBJECT_SCHEMA, SchemaRefused, check_json_schema
from lorafaas.function_runtime.messages import MAX_LOGPROBS, ToolCall

DIGEST_PATTERN = re.compile(r"^[0-9a-f]{64}$")
LORA_MODES = ("local", "remote")  # remote: MoE expert adapters run on the shared LoRA server
MAX_SLO_TTFT_MS = 600_000
MAX_KEEP_ALIVE_S = 86_400.0
MAX_INSTANCES = 64
MAX_TOKENS_LIMIT = 131_072
MAX_REQUEST_S = 3600.0
# JSON's safe integers: every client (JavaScript, OpenAPI tooling) parses them exactly, as doubles; well inside what
# torch's generator and msgpack carry. A seed outside is a 422 on every route (sync, streaming, async, OpenAI).
MIN_SEED, MAX_SEED = -(2**53 - 1), 2**53 - 1  # within 64 bits (the wire, torch) and exact in every JSON client
InvocationStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
INVOCATION_STATUSES: tuple[str, ...] = ("queued", "running", "succeeded", "failed", "cancelled")
TERMINAL_STATUSES: tuple[str, ...] = ("succeeded", "failed", "cancelled")




def check_seed(seed: int | None) -> None:
    if seed is not None and not MIN_SEED <= seed <= MAX_SEED:
        raise InvalidInput(f"seed is {seed}; it must be an integer between {MIN_SEED} and {MAX_SEED}")


def check_digest(digest: str, what: str = "adapter digest") -> str:
    if not isinstance(digest, str) or not DIGEST_PATTERN.match(digest):
        raise InvalidInput(f"{what} {digest!r} is invalid: expected 64 lowercase hex characters (a sha256)")
    return digest


def _check_range(what: str, value: float, low: float, high: float, unit: str = "") -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidInput(f"{what} is {value}; it must be a finite number between {low:g} and {high:g}{unit}")
    if not low <= value <= high:
        raise InvalidInput(f"{what} is {value:g}{unit}; it must be between {low:g} and {high:g}{unit}")


class FunctionSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A deployed function: one adapter on one backbone, with its SLO and scaling bounds (the desired state)."""

    name: str
    tenant: str
    backbone: str
    adapter_digest: str  # sha256 hex of the adapter in the adapter store
    slo_ttft_ms: int = 1000
    keep_alive_s: float = 60.0
    min_instances: int = 0
    max_instances: int = 4
    max_tokens_limit: int = 1024
    max_request_s: float = 300.0  # wall time of one invocation, queueing included; past it the request is stopped
    # Expert adapters on MoE backbones: "remote" (the node's LoRA server runs the experts' LoRA) or "local" (each
    # instance holds them); None: remote. Refused on dense backbones at deploy.
    lora_mode: str | None = None
    # Whether its steps may go to the node's shared base pass (a CPU node's default): false keeps every product of
    # its backbone in its own process, whatever the load (its activations never leave it)
    shared_base: bool = True
    version: int = 1  # bumped by each update
    # One deployment of the name: set at deploy, kept by updates, never reused by a redeploy under the same name, so
    # an instance, a log file or a queued request of a deleted function can never be taken for its successor's.
    # A record written before uids existed gets one derived from its name and creation time (stable across reads).
    uid: str = ""
    created_at: float
    updated_at: float

    def __post_init__(self) -> None:
        if not self.uid:
            derived = hashlib.sha256(f"{self.name}:{self.created_at!r}".encode()).hexdigest()[:16]
            msgspec.structs.force_setattr(self, "uid", derived)

    @property
    def identity(self) -> tuple[str, str, str, int, str]:
        """What an instance must match to serve this spec: tenant, name, deployment, version, adapter."""
        return (self.tenant, self.name, self.uid, self.version, self.adapter_digest)

    def check(self) -> FunctionSpec:
        """Raise InvalidInput (or InvalidName) naming the first field out of bounds; return self."""
        check_name(self.name, "function")
        check_name(self.tenant, "tenant")
        check_name(self.backbone, "backbone")
        check_digest(self.adapter_digest)
        _check_range("slo_ttft_ms", self.slo_ttft_ms, 1, MAX_SLO_TTFT_MS, " ms")
        _check_range("keep_alive_s", self.keep_alive_s, 0, MAX_KEEP_ALIVE_S, " s")
        _check_range("max_instances", self.max_instances, 1, MAX_INSTANCES)
        _check_range("min_instances", self.min_instances, 0, MAX_INSTANCES)
        if self.min_instances > self.max_instances:
            raise InvalidInput(
                f"min_instances is {self.min_instances} but max_instances is {self.max_instances}; "
                "min_instances must not exceed max_instances"
            )
        _check_range("max_tokens_limit", self.max_tokens_limit, 1, MAX_TOKENS_LIMIT)
        _check_range("max_request_s", self.max_request_s, 0.1, MAX_REQUEST_S, " s")
        if self.lora_mode is not None and self.lora_mode not in LORA_MODES:
            raise InvalidInput(f"lora_mode is {self.lora_mode!r}; expected one of {', '.join(LORA_MODES)}")
        if self.version < 1:
            raise InvalidInput(f"version is {self.version}; versions start at 1")
        if self.updated_at < self.created_at:
            raise InvalidInput(f"updated_at {self.updated_at} is before created_at {self.created_at}")
        return self


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: str  # "system" | "user" | "assistant" | "tool"
    content: str
    tool_call_id: str | None = None  # a tool turn: the call it answers
    tool_calls: list[ToolCall] | None = None  # an assistant turn: the calls it made
    name: str | None = None


class ResponseFormat(msgspec.Struct, frozen=True, kw_only=True):
    """OpenAI's response_format: free text, any JSON object, or JSON matching `schema` (JSON Schema as JSON text)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    schema: str | None = None  # json_schema only
    name: str | None = None  # json_schema only: the schema's name (OpenAI requires one)
    strict: bool | None = None  # accepted either way: the schema is always enforced exactly

    def check(self) -> None:
        if self.type == "json_schema":
            if self.schema is None:
                raise SchemaRefused("response_format.json_schema.schema is required with type json_schema")
            check_json_schema(self.schema)
        elif self.schema is not None:
            raise SchemaRefused(f"response_format of type {self.type} takes no schema; use type json_schema")

    @property
    def json_schema(self) -> str | None:
        """The schema the output is constrained to; None for free text."""
        return {"text": None, "json_object": JSON_OBJECT_SCHEMA}.get(self.type, self.schema)


class InvocationRequest(msgspec.Struct, frozen=True, kw_only=True):
    """What was asked: a plain `prompt` or chat `messages` (exactly one), and the sampling parameters."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    prompt_token_ids: list[int] | None = None  # a prompt already tokenized (the OpenAI API's token-id prompts)
    max_tokens: int = 128
    max_tokens_exact: bool = False  # asked for by the caller (not a default): never cut short by the context
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = []
    seed: int | None = None
    # vLLM's sampling parameters beyond OpenAI's basic ones (their defaults switch them off)
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    logprobs: int | None = None  # the sampled token's logprob and this many alternatives per token
    ignore_eos: bool = False
    response_format: ResponseFormat | None = None  # None: free text
    tools: str | None = None  # chat only: OpenAI tool definitions (JSON text), rendered by the chat template

    def check(self, max_tokens_limit: int = MAX_TOKENS_LIMIT) -> InvocationRequest:
        """Raise InvalidInput naming the first field out of bounds; return self."""
        if sum(given is not None for given in (self.prompt, self.messages, self.prompt_token_ids)) != 1:
            raise InvalidInput("give exactly one of 'prompt' or 'messages'")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise InvalidInput("'prompt' holds no token ids; give at least one")
        if self.messages is not None and not self.messages:
            raise InvalidInput("'messages' is empty; give at least one message")
        _check_range("max_tokens", self.max_tokens, 1, max_tokens_limit)
        _check_range("temperature", self.temperature, 0.0, 2.0)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidInput(f"top_p is {self.top_p:g}; it must be greater than 0 and at most 1")
        check_seed(self.seed)
        if self.top_k < -1:
            raise InvalidInput(f"top_k is {self.top_k}; it must be -1 or 0 (off) or at least 1")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if not (math.isfinite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 100.0):
            raise InvalidInput(f"repetition_penalty is {self.repetition_penalty}; it must be in (0, 100]")
        for token_id, bias in self.logit_bias.items():
            _check_range(f"logit_bias[{token_id}]", bias, -100.0, 100.0)
        if self.logprobs is not None:
            _check_range("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.response_format is not None:
            self.response_format.check()
        return self


class InvocationRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One invocation's lifecycle: queued -> running -> succeeded | failed | cancelled; kept until `expires_at`."""

    invocation_id: str
    function: str
    tenant: str
    deployment: str = ""  # the function's uid when it was accepted: a redeploy under the name never runs it
    key_id: str = ""  # the API key that submitted it: revoking the key cancels it
    status: InvocationStatus
    request: InvocationRequest
    result_text: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error_code: str | None = None
    error_message: str | None = None
    created_at: float
    updated_at: float
    expires_at: float  # retention deadline: `delete_expired_invocations(now)` removes the record after it

    @property
    def is_finished(self) -> bool:
        return self.status in TERMINAL_STATUSES


class UsageRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One finished invocation as billed: who, what, how long, and what it was charged (platform/metering.py).
    Kept for good (billing history); times in seconds."""

    invocation_id: str  # for a keep_alive record: "keep-alive-<instance id>"
    # "keep_alive": no invocation, the last idle period of an instance, charged when it stopped (memory_idle only)
    kind: Literal["invocation", "keep_alive"] = "invocation"
    tenant: str
    function: str
    deployment: str  # the function's uid: a redeploy under the name is billed apart
    instance_id: str = ""
    finished_at: float  # unix time
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_s: float = 0.0  # arrival at the node agent -> dispatched to an instance
    ttft_s: float = 0.0  # arrival -> first event
    e2e_s: float = 0.0  # arrival -> finished
    cold_start: str = "warm"  # "warm", or the kind of the instance start it waited for
    cold_start_s: dict[str, float] = {}  # that start's stages: spawn, libraries, backbone, adapter, total
    device_s: float = 0.0  # its share of its device while it ran
    memory_active_gb_s: float = 0.0  # bytes it ran with x device_s
    memory_idle_gb_s: float = 0.0  # its pre-loaded artifacts x the keep-alive time before it
    keep_alive_s: float = 0.0

    @property
    def memory_gb_s(self) -> float:
        return self.memory_active_gb_s + self.memory_idle_gb_s


class ApiKeyRecord(msgspec.Struct, frozen=True, kw_only=True):
    """An API key as stored: only its sha256, never the key itself."""

    key_id: str  # public, short; shown in listings and logs
    tenant: str
    key_hash: str
    is_admin: bool = False
    created_at: float
    # When the key last authenticated a request, to the minute (auth.KEY_USE_RESOLUTION_S); None: never.
    last_used_at: float | None = None
