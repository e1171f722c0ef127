"""Choosing the next token and turning tokens into streamed text (stop strings, partial UTF-8)."""

from __future__ import annotations

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


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Greedy below MIN_TEMPERATURE; otherwise temperature + nucleus (top_p) sampling. `logits` is [vocab].
    The nucleus always holds the most likely token, however small top_p is (1e-300 is 0 in float32)."""
    if is_greedy(params):
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= params.top_p
        outside[0] = False
        sorted_probs[outside] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


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
        backend = getattr(tokenizer, "_tokenizer", None)  # the Rust tokenizer behind a PreTrainedTokenizerFast
        self._backend = backend
        self._decoder = DecodeStream(skip_special_tokens=True) if self._backend is not None else None
        self._decoded = ""  # the incremental decoder's text so far
        self._fed = 0  # output tokens given to the incremental decoder

    def push(self, output_ids: list[int]) -> str:
        full = self._decode_incrementally(output_ids)
        for stop in self._stop:
            at = full.find(stop, max(0, len(self.text) - len(stop) + 1))
            if at != -1:
                self.stopped = True
                return self._advance(full[:at])
        safe = full.rstrip(REPLACEMENT_CHAR) if full.endswith(REPLACEMENT_CHAR) else full
        held = max((_overlap(safe, stop) for stop in self._stop), default=0)
        return self._advance(safe[: len(safe) - held])

    def finish(self, output_ids: list[int]) -> str:
        """Flush what was held back (the request ended without reaching a stop string)."""
        if self.stopped:
            return ""
        return self._advance(self._tokenizer.decode(output_ids, skip_special_tokens=True))

    def _decode_incrementally(self, output_ids: list[int]) -> str:
        if self._decoder is None:
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
