"""Choosing the next token and turning tokens into streamed text (stop strings, partial UTF-8)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tokenizers.decoders import DecodeStream

from lorafaas.function_runtime.messages import SamplingParams

REPLACEMENT_CHAR = "\ufffd"  # what decode() yields for an incomplete multi-byte character
# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): dividing logits by 1e-300 overflows to inf and
# the distribution would be NaN.
MIN_TEMPERATURE = 1e-5


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < MIN_TEMPERATURE


def new_generator(params: SamplingParams) -> torch.Generator | None:
    """A private generator per request, so a seeded request samples the same tokens whatever it is batched with."""
    if is_greedy(params):
        return None
    generator = torch.Generator()
    if params.seed is not None:
        generator.manual_seed(params.seed)
    else:
        generator.seed()
    return generator


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
               prompt_ids: Sequence[int] = (), output_ids: Sequence[int] = (),
               allowed: torch.Tensor | None = None) -> int:
    """The next token from one row's `logits` ([vocab]) in vLLM's order: logit_bias, then the penalties (repetition
    over prompt + output, frequency and presence over the output), then the grammar's mask (`allowed`, a bool
    [vocab]: a token outside it is never chosen), then greedy below MIN_TEMPERATURE, otherwise a draw from
    `sampling_probs`."""
    logits = processed_logits(logits, params, prompt_ids, output_ids, allowed)
    if is_greedy(params):
        return int(torch.argmax(logits))
    return int(torch.multinomial(sampling_probs(logits, params).cpu(), 1, generator=generator))


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a token is drawn from, given processed float32 logits: temperature, then min_p (relative to
    the most likely token), top_k (ties with the k-th kept), top_p (over what top_k left, renormalized).
    The nucleus always holds the most likely token, however small top_p is (1e-300 is 0 in float32)."""
    logits = logits / params.temperature
    if params.min_p > 0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= params.top_p
        outside[0] = False
        sorted_probs[outside] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs / sorted_probs.sum())
    return probs


def processed_logits(logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int] = (),
                     output_ids: Sequence[int] = (), allowed: torch.Tensor | None = None) -> torch.Tensor:
    """`logits` in float32 with logit_bias, the penalties and the grammar's mask applied (what greedy decoding takes
    the argmax of)."""
    logits = logits.float()
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=logits.device)
        bias = torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype, device=logits.device)
        logits = logits.index_add(0, ids, bias)
    if params.repetition_penalty != 1:
        seen = _token_counts(list(prompt_ids) + list(output_ids), logits) > 0
        factor = torch.where(seen, params.repetition_penalty, 1.0).to(logits.dtype)
        logits = torch.where(logits > 0, logits / factor, logits * factor)
    if (params.frequency_penalty or params.presence_penalty) and output_ids:
        counts = _token_counts(output_ids, logits)
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(logits.dtype)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    return logits


_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)


def allowed_from_bitmask(bitmask: bytes, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A grammar's bitmask (bit i of little-endian 32-bit words: token i allowed) as a bool [vocab_size] tensor; a
    token past the bitmask (a model's padded vocabulary) is not allowed."""
    bits = torch.frombuffer(bytearray(bitmask), dtype=torch.uint8)
    allowed = ((bits.unsqueeze(1) >> _BIT_SHIFTS) & 1).flatten().bool()
    if allowed.numel() < vocab_size:
        allowed = torch.cat([allowed, allowed.new_zeros(vocab_size - allowed.numel())])
    return allowed[:vocab_size].to(device)


def _token_counts(token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
    """How often each vocabulary entry occurs in `token_ids`, as a float [vocab] tensor on the logits' device."""
    ids = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
    return torch.bincount(ids, minlength=logits.shape[-1])[: logits.shape[-1]].to(logits.dtype)


def token_logprobs(logits: torch.Tensor, token_id: int, num_top: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of `token_id` and the `num_top` most likely tokens (id, logprob), most likely first:
    log-softmax of the raw logits, before bias, penalties, temperature and truncation (vLLM's raw_logprobs)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logprobs, num_top) if num_top else None
    sampled = float(logprobs[token_id])
    if top is None:
        return sampled, []
    return sampled, list(zip(top.indices.tolist(), top.values.tolist(), strict=True))


class TextStream:
    """Incremental detokenization of one request's output with stop strings.

    `push(ids)` takes the output so far (one token more than the last call) and returns the new text safe to show: it
    holds back an incomplete UTF-8 character and any tail that could still become a stop string, and reports whether
    a stop string was reached (the text is cut before it). A fast tokenizer decodes one token per call through
    tokenizers' `DecodeStream` (which buffers partial characters); other tokenizers re-decode the whole output.
    `finish` settles on the whole output decoded once, so the final text is exactly `decode(output_ids)`.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...]) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self.text = ""  # all text shown so far
        self.stopped = False
        self._backend = getattr(tokenizer, "_tokenizer", None)  # the Rust tokenizer of a PreTrainedTokenizerFast
        self._decoder = DecodeStream(skip_special_tokens=True) if self._backend is not None else None
        self._decoded = ""  # the incremental decoder's text so far
        self._fed = 0  # output tokens given to the incremental decoder

    def push(self, output_ids: list[int]) -> str:
        full = self._decode_incrementally(output_ids)
        # a trailing replacement character is a character still incomplete, not text: no stop string matches it
        safe = full.rstrip(REPLACEMENT_CHAR) if full.endswith(REPLACEMENT_CHAR) else full
        stopped = self._stopped_in(safe)
        if stopped is not None:
            return stopped
        held = max((_overlap(safe, stop) for stop in self._stop), default=0)
        return self._advance(safe[: len(safe) - held])

    def finish(self, output_ids: list[int]) -> str:
        """Flush what was held back (the request ended without a stop string in what was shown). The whole output
        decoded once is final, bytes that never made a character included: a stop string in it still stops."""
        if self.stopped:
            return ""
        final = self._tokenizer.decode(output_ids, skip_special_tokens=True)
        stopped = self._stopped_in(final)
        return self._advance(final) if stopped is None else stopped

    def _stopped_in(self, text: str) -> str | None:
        """The new text up to the first stop string (in `stop`'s order) reached in `text`, or None."""
        for stop in self._stop:
            at = text.find(stop, max(0, len(self.text) - len(stop) + 1))
            if at != -1:
                self.stopped = True
                return self._advance(text[:at])
        return None

    def _decode_incrementally(self, output_ids: list[int]) -> str:
        if self._decoder is None or self._backend is None:  # (both or neither)
            return self._tokenizer.decode(output_ids, skip_special_tokens=True)
        for token_id in output_ids[self._fed:]:
            chunk = self._decoder.step(self._backend, token_id)
            if chunk is not None:
                self._decoded += chunk
        self._fed = len(output_ids)
        return self._decoded

    def _advance(self, upto: str) -> str:
        if len(upto) <= len(self.text):
            return ""
        delta = upto[len(self.text):]
        self.text = upto
        return delta


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for size in range(min(len(text), len(stop) - 1), 0, -1):
        if stop.startswith(text[-size:]):
            return size
    return 0
