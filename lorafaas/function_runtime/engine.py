"""Continuous batching for one function instance: its own KV cache, requests joining between decode steps.

Each `step()` runs one batched decode step for every running request, then admits the waiting requests that fit:
they are prefilled together in one forward pass (left-padded), each gets its first token, and their KV caches are
merged into the batch (left-padded, with an attention mask and explicit positions, so every row sees exactly its own
tokens). Finished rows leave the batch at once.

The engine is driven by one thread (the worker's compute loop); `add` and `cancel` may be called from another thread
between steps.

Every tensor the engine makes is made on the model's device (`self.device`): ids, masks, positions, indices. The one
place device data comes back to the host is `_sample` (a row's logits -> a token id), the data-dependent boundary;
everything else is computed from host-side lengths, so a step never waits on the device except there.
`tests/unit/test_engine_fake_cuda.py` runs prefill and decode on `cuda:0` under FakeTensorMode up to that boundary.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jinja2
import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from lorafaas.errors import InvalidInput, PromptTooLong
from lorafaas.function_runtime.base_pass import BasePassClient
from lorafaas.function_runtime.decode_step import decode_step
from lorafaas.function_runtime.grammar import GrammarCompiler, GrammarMatcher
from lorafaas.function_runtime.memory import release_free_memory
from lorafaas.function_runtime.messages import FinishReason, SamplingParams, TokenLogprob, TokenLogprobs
from lorafaas.function_runtime.sampling import (
    TextStream,
    allowed_from_bitmask,
    new_generator,
    next_token,
    token_logprobs,
)
from lorafaas.models.reference import chat_template_ids

# transformers 5.2x renamed the KV cache's argument and output field from `past_key_values` to `cache`, and warns on
# every use of the old name (into each worker's log): use the name the installed version defines
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 8
    max_context: int | None = None  # default: the model's max_position_embeddings
    # Token budget of one prefill pass (rows x padded width): bounds its activations and attention scores, so
    # eight near-context prompts are prefilled one pass after another, and a prompt longer than the budget in
    # chunks of it, instead of all at once.
    max_prefill_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")


@dataclass(frozen=True)
class StepOutput:
    request_id: str
    token_id: int | None  # None when a request ends without a new token (cancelled)
    text: str  # new text to show
    finish_reason: FinishReason | None = None
    full_text: str = ""  # set when finished
    prompt_tokens: int = 0  # set on the first token (its prefill) and when finished
    completion_tokens: int = 0
    prefill_s: float | None = None  # on a request's first token: the forward time of the prefill it was in
    prefill_batch: int | None = None  # how many requests that prefill held
    error: str | None = None  # this request failed alone (its batch-mates go on); finish_reason is "error"
    logprobs: TokenLogprobs | None = None  # of token_id, when the request asked for them


@dataclass
class _Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    stream: TextStream
    generator: torch.Generator | None
    grammar: GrammarMatcher | None = None  # structured output: masks each step's logits; complete -> the request ends
    output_ids: list[int] = field(default_factory=list)


class GenerationEngine:
    def __init__(
        self, model, tokenizer, config: EngineConfig | None = None, clock: Callable[[], float] = time.perf_counter,
        base_pass: BasePassClient | None = None, release_memory: Callable[[], None] = release_free_memory,
    ) -> None:
        self.model = model
        self.release_memory = release_memory  # called when the batch drains with nothing waiting
        self.base_pass = base_pass  # the shared base pass `model` is installed in, handed to each decode step
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.clock = clock
        self.device = model.device
        self.max_context = self.config.max_context or int(model.config.max_position_embeddings)
        self.eos_ids = _eos_ids(model, tokenizer)
        self.vocab_size = int(getattr(model.config, "vocab_size", None) or len(tokenizer))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids, default=0)
        self.grammars = GrammarCompiler(tokenizer, self.eos_ids)
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._cancelled: set[str] = set()
        # The batch: one row per running sequence, all tensors aligned on dim 0.
        self._running: list[_Sequence] = []
        self._cache: Any = None  # a transformers Cache while a batch runs
        self._mask: torch.Tensor | None = None  # [rows, cached_len] 1 = real token, 0 = left padding
        self._positions: torch.Tensor | None = None  # [rows] position of each row's next token
        self._next_input: torch.Tensor | None = None  # [rows] last sampled token, fed at the next decode

    # -- requests ------------------------------------------------------------------------------------------------

    def encode_chat(self, messages: list[dict], tools: str | None = None) -> list[int]:
        """`tools`: OpenAI tool definitions as a JSON list, given to the chat template as `tools` (as vLLM does)."""
        try:
            if tools is None:
                return chat_template_ids(self.tokenizer, messages)
            ids = self.tokenizer.apply_chat_template(messages, tools=json.loads(tools), add_generation_prompt=True)
        except jinja2.TemplateError as exc:  # the template's own refusal (roles out of order, a tool turn, ...)
            raise InvalidInput(f"the backbone's chat template refused the messages: {exc}") from exc
        return list(ids["input_ids"] if hasattr(ids, "input_ids") else ids)

    def encode_text(self, prompt: str) -> list[int]:
        # With the tokenizer's special tokens (a BOS where it adds one), as vLLM tokenizes a raw completion prompt.
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def check_token_ids(self, token_ids) -> list[int]:
        vocab_size = self.model.get_input_embeddings().num_embeddings
        for i, token_id in enumerate(token_ids):
            if not 0 <= token_id < vocab_size:
                raise InvalidInput(f"prompt token {i} is {token_id}; token ids are between 0 and {vocab_size - 1}",
                                   param="prompt")
        return list(token_ids)

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; raises PromptTooLong or InvalidInput before anything is queued."""
        params.check(self.max_context)
        params.check_vocab(self.vocab_size)
        if not prompt_ids:
            raise InvalidInput("the prompt is empty")
        if len(prompt_ids) >= self.max_context:
            raise PromptTooLong(
                f"prompt has {len(prompt_ids)} tokens; the context window is {self.max_context} tokens"
            )
        room = self.max_context - len(prompt_ids)
        if params.max_tokens_exact and params.max_tokens > room:
            raise PromptTooLong(
                f"prompt has {len(prompt_ids)} tokens and max_tokens is {params.max_tokens}: together they exceed "
                f"the context window of {self.max_context} tokens; ask for at most {room}, or omit max_tokens"
            )
        grammar = self.grammars.matcher(params.json_schema) if params.json_schema is not None else None
        self._waiting.append(_Sequence(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            max_new_tokens=min(params.max_tokens, room),
            stream=TextStream(self.tokenizer, params.stop),
            generator=new_generator(params),
            grammar=grammar,
        ))

    def cancel(self, request_id: str) -> None:
        self._cancelled.add(request_id)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_work(self) -> bool:
        return bool(self._running or self._waiting or self._cancelled)

    # -- the loop ------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        outputs = self._drop_cancelled()
        if self._running:
            outputs += self._decode()
        room = self.config.max_batch_size - len(self._running)
        if self._waiting and room > 0:
            outputs += self._admit(self._take_within_budget(room))
        return outputs

    def _take_within_budget(self, room: int) -> list[_Sequence]:
        """The waiting requests, oldest first, whose left-padded prefill fits the token budget (at least one)."""
        taken = [self._waiting.popleft()]
        width = len(taken[0].prompt_ids)
        while self._waiting and len(taken) < room:
            wider = max(width, len(self._waiting[0].prompt_ids))
            if (len(taken) + 1) * wider > self.config.max_prefill_tokens:
                break
            taken.append(self._waiting.popleft())
            width = wider
        return taken

    def _drop_cancelled(self) -> list[StepOutput]:
        if not self._cancelled:
            return []
        cancelled, self._cancelled = self._cancelled, set()
        outputs = []
        for seq in [s for s in self._waiting if s.request_id in cancelled]:
            self._waiting.remove(seq)
            outputs.append(self._finished(seq, None, "", "cancelled"))
        rows = [i for i, s in enumerate(self._running) if s.request_id in cancelled]
        for i in rows:
            outputs.append(self._finished(self._running[i], None, "", "cancelled"))
        self._remove_rows(set(rows))
        return outputs

    def _decode(self) -> list[StepOutput]:
        rows = len(self._running)
        _, batch_mask, batch_positions, next_input = self._batch()
        mask = torch.cat([batch_mask, torch.ones((rows, 1), dtype=batch_mask.dtype, device=self.device)], dim=1)
        ids, positions = next_input.unsqueeze(1), batch_positions.unsqueeze(1)
        # the cache updated in place
        logits = decode_step(self.model, ids, mask, positions, self._cache, base_pass=self.base_pass)
        if logits is None:  # not a plain Llama: HF's forward
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                             **{CACHE_FIELD: self._cache})
            self._cache, logits = getattr(out, CACHE_FIELD), out.logits
        self._mask = mask
        self._positions = batch_positions + 1
        logits = logits[:, -1, :]
        outputs, done = [], set()
        for row, seq in enumerate(self._running):
            output = self._next(seq, logits[row])
            outputs.append(output)
            if output.finish_reason is not None or output.token_id is None:  # no token without a finish reason
                done.add(row)
            else:
                next_input[row] = output.token_id
        self._remove_rows(done)
        return outputs

    def _admit(self, seqs: list[_Sequence]) -> list[StepOutput]:
        """Prefill the waiting requests in one forward pass (left-padded), each gets its first token, and those that go
        on join the batch. One pass for the lot: every one of them has its first token when the last would have had
        it prefilled alone, and sooner in total time."""
        width = max(len(seq.prompt_ids) for seq in seqs)
        ids = torch.tensor([[self.pad_id] * (width - len(seq.prompt_ids)) + seq.prompt_ids for seq in seqs],
                           device=self.device)
        mask = torch.tensor([[0] * (width - len(seq.prompt_ids)) + [1] * len(seq.prompt_ids) for seq in seqs],
                            device=self.device)
        started = self.clock()
        out = self._prefill(ids, mask)
        self._synchronize()  # on a GPU the forward only launched kernels: time them, not their launch
        prefill_s = self.clock() - started
        outputs, joining = [], []
        for row, seq in enumerate(seqs):
            output = dataclasses.replace(self._next(seq, out.logits[row, -1, :]), prefill_s=prefill_s,
                                         prefill_batch=len(seqs), prompt_tokens=len(seq.prompt_ids))
            outputs.append(output)
            if output.finish_reason is None and output.token_id is not None:  # (no token: a finish reason)
                joining.append((row, seq, output.token_id))
        if joining:
            self._join(joining, getattr(out, CACHE_FIELD), mask)
        return outputs

    def _next(self, seq: _Sequence, logits: torch.Tensor) -> StepOutput:
        """The sequence's next token, or its failure alone: one request's sampling parameters must never fail the
        requests batched with it."""
        try:
            token_id = self._sample(logits, seq)
            logprobs = self._logprobs(logits, seq, token_id)
            if seq.grammar is not None and token_id not in self.eos_ids:
                seq.grammar.accept(token_id)
        except (RuntimeError, ValueError) as exc:
            failed = self._finished(seq, None, "", "error")
            return dataclasses.replace(failed, error=f"sampling failed for this request: {exc}")
        output = self._emit(seq, token_id)
        return output if logprobs is None else dataclasses.replace(output, logprobs=logprobs)

    def _sample(self, logits: torch.Tensor, seq: _Sequence) -> int:
        """The data-dependent boundary: one row's logits ([vocab], on the device) -> the next token id, on the host.
        A constrained row's mask comes from its own grammar state: its batch-mates never see it."""
        allowed = None if seq.grammar is None else \
            allowed_from_bitmask(seq.grammar.allowed_bitmask(), logits.shape[-1], logits.device)
        return next_token(logits, seq.params, seq.generator, seq.prompt_ids, seq.output_ids, allowed)

    def _logprobs(self, logits: torch.Tensor, seq: _Sequence, token_id: int) -> TokenLogprobs | None:
        if seq.params.logprobs is None:
            return None
        sampled, top = token_logprobs(logits, token_id, seq.params.logprobs)
        decode = self.tokenizer.decode
        return TokenLogprobs(sampled=TokenLogprob(token_id, decode([token_id]), sampled),
                             top=tuple(TokenLogprob(i, decode([i]), lp) for i, lp in top))

    def _synchronize(self) -> None:
        if self.device.type == "cuda" and torch.cuda.is_initialized():
            torch.cuda.synchronize(self.device)

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor):
        """One forward pass; a single prompt over the token budget goes through in chunks of it, each chunk attending
        to the cache of the ones before (the same attention). Only the last position's logits are computed (as
        `generate` does): a [rows, width, vocab] tensor would outweigh the rest of the pass."""
        chunk = self.config.max_prefill_tokens
        if ids.shape[0] > 1 or ids.shape[1] <= chunk:
            return self.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                              use_cache=True, logits_to_keep=1)
        cache, out = None, None
        for start in range(0, ids.shape[1], chunk):
            end = min(start + chunk, ids.shape[1])
            positions = torch.arange(start, end, device=self.device).unsqueeze(0)
            out = self.model(input_ids=ids[:, start:end], attention_mask=mask[:, :end], position_ids=positions,
                             use_cache=True, logits_to_keep=1, **{CACHE_FIELD: cache})
            cache = getattr(out, CACHE_FIELD)
        return out

    def _emit(self, seq: _Sequence, token_id: int) -> StepOutput:
        if token_id in self.eos_ids and not seq.params.ignore_eos:
            # The sampled EOS counts as a completion token (as vLLM counts it), though it adds no text.
            return self._finished(seq, token_id, seq.stream.finish(seq.output_ids), "stop", num_eos=1)
        seq.output_ids.append(token_id)
        text = seq.stream.push(seq.output_ids)
        if seq.stream.stopped:
            return self._finished(seq, token_id, text, "stop")
        if seq.grammar is not None and seq.grammar.is_complete:  # the JSON value is closed: nothing may follow
            return self._finished(seq, token_id, text + seq.stream.finish(seq.output_ids), "stop")
        if len(seq.output_ids) >= seq.max_new_tokens:
            text += seq.stream.finish(seq.output_ids)  # the final text may still reach a stop string
            return self._finished(seq, token_id, text, "stop" if seq.stream.stopped else "length")
        return StepOutput(request_id=seq.request_id, token_id=token_id, text=text)

    def _finished(self, seq: _Sequence, token_id: int | None, text: str, reason: FinishReason,
                  num_eos: int = 0) -> StepOutput:
        return StepOutput(
            request_id=seq.request_id, token_id=token_id, text=text, finish_reason=reason,
            full_text=seq.stream.text, prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.output_ids) + num_eos,
        )

    # -- the batch's KV cache --------------------------------------------------------------------------------------

    def _join(self, joining: list[tuple[int, _Sequence, int]], cache, mask: torch.Tensor) -> None:
        """Append prefilled rows (row of the prefill batch, sequence, first token) to the batch, left-padding whichever
        side is shorter."""
        index = torch.tensor([row for row, _, _ in joining], device=self.device)
        new_mask = mask[index]
        # Columns that are padding in every joining row go (from host-side lengths: no device sync).
        first_real = mask.shape[1] - max(_cached_len(seq) for _, seq, _ in joining)
        new_mask = new_mask[:, first_real:]
        for layer in cache.layers:
            layer.keys = layer.keys[index, :, first_real:]
            layer.values = layer.values[index, :, first_real:]
        lengths = new_mask.sum(dim=1)
        tokens = torch.tensor([token_id for _, _, token_id in joining], device=self.device)
        if not self._running:
            self._cache, self._mask, self._positions, self._next_input = cache, new_mask, lengths, tokens
        else:
            batch_cache, batch_mask, positions, next_input = self._batch()
            width = max(batch_mask.shape[1], new_mask.shape[1])
            for batch_layer, new_layer in zip(batch_cache.layers, cache.layers, strict=True):
                batch_layer.keys = torch.cat([_left_pad(batch_layer.keys, width), _left_pad(new_layer.keys, width)])
                batch_layer.values = torch.cat(
                    [_left_pad(batch_layer.values, width), _left_pad(new_layer.values, width)]
                )
            self._mask = torch.cat([_left_pad(batch_mask, width), _left_pad(new_mask, width)])
            self._positions = torch.cat([positions, lengths])
            self._next_input = torch.cat([next_input, tokens])
        self._running.extend(seq for _, seq, _ in joining)

    def _remove_rows(self, rows: set[int]) -> None:
        if not rows:
            return
        keep = [i for i in range(len(self._running)) if i not in rows]
        self._running = [self._running[i] for i in keep]
        if not keep:
            self._cache = self._mask = self._positions = self._next_input = None
            if not self._waiting:  # idle: the batch's KV cache and activations go back to the machine
                self.release_memory()
            return
        index = torch.tensor(keep, device=self.device)
        cache, mask, positions, next_input = self._batch()
        # Columns that are padding in every remaining row can go (from host-side lengths: no device sync).
        first_real = mask.shape[1] - max(_cached_len(self._running[i]) for i in range(len(keep)))
        for layer in cache.layers:
            layer.keys = layer.keys[index, :, first_real:]
            layer.values = layer.values[index, :, first_real:]
        self._mask = mask[index, first_real:]
        self._positions = positions[index]
        self._next_input = next_input[index]

    def _batch(self) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The running batch's KV cache, mask, positions and next inputs (all set while a sequence runs)."""
        if self._cache is None or self._mask is None or self._positions is None or self._next_input is None:
            raise RuntimeError("no batch is running")
        return self._cache, self._mask, self._positions, self._next_input


def _cached_len(seq: _Sequence) -> int:
    """Tokens of `seq` in the KV cache between steps: its prompt and every output token but the last (fed next)."""
    return len(seq.prompt_ids) + len(seq.output_ids) - 1


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Pad the sequence dimension (-2 for [batch, heads, seq, dim] caches, -1 for [batch, seq] masks) on the left."""
    seq_dim = -1 if tensor.dim() == 2 else -2
    missing = width - tensor.shape[seq_dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[seq_dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=seq_dim)


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return frozenset(i for i in ids if i is not None)
