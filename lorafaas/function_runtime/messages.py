"""The function worker's protocol: typed messages over its Unix socket, shared by the worker and its clients.

Frames are length-prefixed msgpack (`lorafaas.wire`). A client opens with `Hello` and must get `HelloReply` with the
same `PROTOCOL_VERSION` before anything else. Requests and replies are tagged unions; events about a generation carry
its `request_id`, so one connection can multiplex many requests.
"""

from __future__ import annotations

import json
from typing import Literal

import msgspec

PROTOCOL_VERSION = 2  # 2: Generate.prompt_token_ids, tool turns in ChatMessage

# The artifact kinds the scheduler reasons about, in loading order.
StageName = Literal["libraries", "backbone", "adapter", "warmup"]
STAGES: tuple[StageName, ...] = ("libraries", "backbone", "adapter", "warmup")
# Undoing stages: adapter device -> host, adapter dropped from host, backbone unbound.
UnstageName = Literal["adapter_offload", "adapter_drop", "backbone"]
FinishReason = Literal["stop", "length", "cancelled", "error"]


MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's top_logprobs bound, vLLM's default max_logprobs)
MAX_LOGIT_BIAS = 100.0  # |bias| bound (OpenAI's)
MAX_PENALTY = 2.0  # |presence_penalty| and |frequency_penalty| bound (OpenAI's and vLLM's)


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """What vLLM's SamplingParams means by the same names (see `sampling.next_token` for the order they apply in)."""

    max_tokens: int = 128
    temperature: float = 0.0  # 0 is greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False  # generate exactly max_tokens (fixed-length benchmarks, as vLLM's)
    # the caller asked for max_tokens: a prompt leaving less room in the context is refused (as vLLM and OpenAI
    # refuse it), where a default max_tokens is only cut short at the context's end
    max_tokens_exact: bool = False
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability; 0: off
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides positive (multiplies negative) logits of prompt and output tokens
    logit_bias: dict[int, float] = {}  # token id -> added to its logit
    logprobs: int | None = None  # None: none; n: the sampled token's logprob and the n most likely alternatives
    json_schema: str | None = None  # JSON text of a JSON Schema the output must match (response_format); None: free

    def check(self, max_tokens_limit: int) -> None:
        from lorafaas.errors import InvalidInput

        if not 1 <= self.max_tokens <= max_tokens_limit:
            raise InvalidInput(f"max_tokens is {self.max_tokens}; it must be between 1 and {max_tokens_limit}")
        if not 0 <= self.temperature <= 100:
            raise InvalidInput(f"temperature is {self.temperature}; it must be between 0 and 100")
        if not 0 < self.top_p <= 1:
            raise InvalidInput(f"top_p is {self.top_p}; it must be in (0, 1]")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise InvalidInput(f"seed is {self.seed}; it must be a signed 64-bit integer")
        if len(self.stop) > 8 or any(not s for s in self.stop):
            raise InvalidInput(f"stop has {len(self.stop)} strings{' (one empty)' if '' in self.stop else ''}; "
                               "it takes at most 8 non-empty strings", param="stop")
        if self.top_k < -1:
            raise InvalidInput(f"top_k is {self.top_k}; it must be -1 or 0 (off) or at least 1")
        if not 0 <= self.min_p <= 1:
            raise InvalidInput(f"min_p is {self.min_p}; it must be between 0 and 1")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise InvalidInput(f"{name} is {getattr(self, name)}; it must be between -2 and 2")
        if not 0 < self.repetition_penalty <= 100:
            raise InvalidInput(f"repetition_penalty is {self.repetition_penalty}; it must be in (0, 100]")
        for token_id, bias in self.logit_bias.items():
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidInput(f"logit_bias[{token_id}] is {bias}; a bias must be between -100 and 100")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidInput(f"logprobs is {self.logprobs}; it must be between 0 and {MAX_LOGPROBS}")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids in logit_bias must name tokens of the model's vocabulary."""
        from lorafaas.errors import InvalidInput

        outside = sorted(t for t in self.logit_bias if not 0 <= t < vocab_size)
        if outside:
            raise InvalidInput(
                f"logit_bias names token ids {outside[:5]} outside the vocabulary (0 to {vocab_size - 1})",
                param="logit_bias",
            )


class ToolCallFunction(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    arguments: str  # JSON text, as the OpenAI API carries it


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    function: ToolCallFunction
    type: str = "function"


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str
    # Tool turns (OpenAI's `tool` messages, an assistant's tool calls): given to the chat template, which renders them.
    tool_call_id: str | None = None
    tool_calls: tuple[ToolCall, ...] | None = None
    name: str | None = None

    def template_dict(self) -> dict:
        """The message as chat templates read it (as vLLM passes it: tool-call arguments parsed from JSON)."""
        message: dict = {"role": self.role, "content": self.content}
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls is not None:
            message["tool_calls"] = [
                {"id": call.id, "type": call.type,
                 "function": {"name": call.function.name, "arguments": _json_or_text(call.function.arguments)}}
                for call in self.tool_calls
            ]
        return message


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


class MemoryStats(msgspec.Struct, frozen=True, kw_only=True):
    rss_bytes: int
    pss_bytes: int
    private_bytes: int  # Private_Clean + Private_Dirty: what this process alone holds
    shared_bytes: int  # Pss_Shmem: this process's share of shared memory (the backbone segment)


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a function worker needs to start: sent to the zygote, or given as JSON on the command line."""

    function: str
    instance_id: str
    socket_path: str  # where the worker listens
    deployment: str | None = None  # the function's deployment uid: its log file belongs to that deployment only
    model_dir: str  # the backbone's store entry (config and tokenizer)
    adapter_dir: str | None = None  # None: serve the plain backbone
    daemon_socket: str | None = None  # the backbone daemon to attach to; None: load the backbone privately
    device: str = "cpu"
    max_batch_size: int = 8
    num_threads: int | None = None  # torch intra-op threads; None: torch's default
    step_gate: str | None = None  # the device's step gate (a Unix socket): cores granted per step; None: ungated
    # The backbone daemon's shared base pass (a Unix socket): the backbone's linear layers computed together with
    # other functions' rows (`lorafaas.protocols.base_pass`); None: every layer computed here.
    base_pass: str | None = None
    # Expert adapters (MoE backbones) only: where their expert LoRA runs; ignored for dense adapters.
    lora_mode: Literal["local", "remote"] | None = None  # None: remote, the default on MoE backbones
    lora_server: str | None = None  # the node's LoRA server for the backbone (a socket path or tcp://HOST:PORT)


class AdapterStats(msgspec.Struct, frozen=True, kw_only=True):
    """The adapter an instance holds: dense LoRA, or an expert adapter whose expert factors are held here (local
    mode) or by the LoRA server (remote mode)."""

    kind: Literal["dense", "experts"]
    lora_mode: Literal["local", "remote"] | None = None  # experts only
    held_bytes: int  # adapter tensor bytes this process holds
    expert_bytes: int = 0  # the adapter's expert factors, wherever they are held


# Requests (client -> worker)
class Hello(msgspec.Struct, frozen=True, tag="hello"):
    version: int
    client: str = ""


class Stage(msgspec.Struct, frozen=True, tag="stage"):
    stage: StageName


class Unstage(msgspec.Struct, frozen=True, tag="unstage"):
    stage: UnstageName


class Generate(msgspec.Struct, frozen=True, kw_only=True, tag="generate"):
    request_id: str
    prompt: str | None = None  # raw text, no chat template
    prompt_token_ids: tuple[int, ...] | None = None  # a prompt already tokenized
    messages: tuple[ChatMessage, ...] | None = None  # rendered with the tokenizer's chat template
    tools: str | None = None  # with messages: tool definitions (a JSON list) the chat template renders
    params: SamplingParams = SamplingParams()


class Cancel(msgspec.Struct, frozen=True, tag="cancel"):
    request_id: str


class GetStats(msgspec.Struct, frozen=True, tag="get_stats"):
    pass


class Shutdown(msgspec.Struct, frozen=True, tag="shutdown"):
    pass


Request = Hello | Stage | Unstage | Generate | Cancel | GetStats | Shutdown


# Replies and events (worker -> client)
class HelloReply(msgspec.Struct, frozen=True, kw_only=True, tag="hello_reply"):
    version: int
    pid: int
    function: str
    instance_id: str


class StageDone(msgspec.Struct, frozen=True, kw_only=True, tag="stage_done"):
    stage: str
    seconds: float
    memory: MemoryStats
    adapter: AdapterStats | None = None  # the adapter held after this step


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    token: str  # the token decoded alone (as vLLM shows it)
    logprob: float


class TokenLogprobs(msgspec.Struct, frozen=True, kw_only=True):
    """A sampled token's log-probability and the most likely alternatives at its position, most likely first:
    log-softmax of the model's raw logits (before bias, penalties, temperature and truncation; vLLM's raw_logprobs)."""

    sampled: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()


class Token(msgspec.Struct, frozen=True, kw_only=True, tag="token"):
    request_id: str
    token_id: int
    text: str  # the new text this token completes (may be empty while a multi-byte character is pending)
    prefill_s: float | None = None  # on the first token: the prefill's forward time (feeds the batching model)
    prefill_batch: int | None = None  # on the first token: how many requests that prefill held
    # on the first token: that prefill ran in the shared base pass, so its time is the round's, not this function's
    prefill_shared: bool = False
    logprobs: TokenLogprobs | None = None  # when the request asked for them
    # on the first token: the prompt's tokens, so a request abandoned before Finished is still charged its prompt
    prompt_tokens: int | None = None


class Finished(msgspec.Struct, frozen=True, kw_only=True, tag="finished"):
    request_id: str
    finish_reason: FinishReason
    text: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    e2e_s: float


class ErrorReply(msgspec.Struct, frozen=True, kw_only=True, tag="error"):
    request_id: str | None
    code: str
    message: str
    param: str | None = None  # the request field at fault (InvalidInput.param)


class Stats(msgspec.Struct, frozen=True, kw_only=True, tag="stats"):
    pid: int
    function: str
    instance_id: str
    stages: tuple[str, ...]  # loaded stages, in order
    stage_seconds: dict[str, float]  # last time each stage took
    memory: MemoryStats
    num_running: int
    num_waiting: int
    num_served: int
    adapter: AdapterStats | None = None
    num_steps: int = 0  # engine steps run so far: the node agent's liveness check watches it advance
    dumpable: bool | None = None  # prctl(PR_GET_DUMPABLE): False, a worker forbids it (protocols.process_guard)


Reply = HelloReply | StageDone | Token | Finished | ErrorReply | Stats


# The zygote's protocol (library pool): one request per connection, answered once.
class Spawn(msgspec.Struct, frozen=True, kw_only=True, tag="spawn"):
    spec: WorkerSpec
    log_path: str  # the worker's stdout and stderr go here


class Spawned(msgspec.Struct, frozen=True, kw_only=True, tag="spawned"):
    pid: int


class Prepare(msgspec.Struct, frozen=True, kw_only=True, tag="prepare"):
    """Hold this backbone's host-side parts (its tokenizer) in the pool, so forked workers inherit them."""

    model_dir: str


class Prepared(msgspec.Struct, frozen=True, kw_only=True, tag="prepared"):
    model_dir: str
    seconds: float


class SpawnStandby(msgspec.Struct, frozen=True, kw_only=True, tag="spawn_standby"):
    """Fork a pool process for no function yet: it attaches the backbone, warms up on a dummy prompt and waits on
    `spec.socket_path` for one `Assign` (function_runtime/standby.py). `spec` names no function (STANDBY_FUNCTION)."""

    spec: WorkerSpec
    log_path: str


class Assign(msgspec.Struct, frozen=True, kw_only=True, tag="assign"):
    """To a pool process, once in its life: become the worker of `spec` (its adapter, socket, limits), logging to
    `log_path`."""

    spec: WorkerSpec
    log_path: str


class Assigned(msgspec.Struct, frozen=True, kw_only=True, tag="assigned"):
    pid: int
    seconds: float  # its backbone attach and warm-up, done before the assignment (off the request path)


class ZygoteStatusRequest(msgspec.Struct, frozen=True, tag="zygote_status"):
    pass


class ZygoteStatus(msgspec.Struct, frozen=True, kw_only=True, tag="zygote_status_reply"):
    pid: int
    children: tuple[int, ...]  # workers still running
    exit_codes: dict[int, int]  # workers that ended: pid -> exit code (negative: killed by that signal)
    import_s: float  # how long importing the libraries took at start
    prepared: tuple[str, ...]  # model directories whose tokenizers the pool holds
    frozen_objects: int = 0  # objects moved out of the collector's reach before forking (`gc.freeze`)


ZygoteRequest = Hello | Spawn | SpawnStandby | Prepare | ZygoteStatusRequest | Shutdown
ZygoteReply = HelloReply | Spawned | Prepared | ZygoteStatus | ErrorReply
StandbyRequest = Hello | Assign
StandbyReply = Assigned | ErrorReply
