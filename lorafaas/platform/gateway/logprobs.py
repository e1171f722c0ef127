"""Per-token log-probabilities as the OpenAI API shapes them, from the workers' `TokenLogprobs`.

What the values are: log-softmax of the model's raw logits at each position, before logit_bias, penalties,
temperature and top-k/top-p/min-p (vLLM's default `logprobs_mode`, raw_logprobs). Shapes follow vLLM's server:

- chat (`logprobs: true`, `top_logprobs: 0..20`): `{"content": [{"token", "logprob", "bytes", "top_logprobs":
  [{"token", "logprob", "bytes"}, ...]}]}`, the alternatives most likely first;
- completions (`logprobs: 0..5`): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, each
  `top_logprobs` entry a {token: logprob} map of the sampled token and the `logprobs` most likely ones (so up to
  logprobs + 1 entries, as OpenAI and vLLM document).

Tokens are shown decoded one by one (`tokenizer.decode([id])`, as vLLM does, so a token holding part of a multi-byte
character shows U+FFFD; `bytes` are that string's UTF-8); logprobs are clamped at -9999.0, as vLLM does (JSON has no
-Infinity). Every generated token has an entry, the end-of-sequence token included (vLLM lists it too).
With `return_tokens_as_token_ids: true` (vLLM's request field) tokens are shown as "token_id:ID" instead, so a token
that is not valid text on its own can still be told apart.
"""

from __future__ import annotations

import msgspec

from lorafaas.function_runtime.messages import TokenLogprob, TokenLogprobs

MIN_LOGPROB = -9999.0  # vLLM's floor: a token the model rules out would otherwise be -inf
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's bound (OpenAI's)


class ChatTopLogprob(msgspec.Struct, kw_only=True):
    """One of a chat token's most likely alternatives (OpenAI's `TopLogprob`)."""

    token: str
    logprob: float
    bytes: list[int]  # the UTF-8 of `token` as shown


class ChatTokenLogprob(msgspec.Struct, kw_only=True):
    """One generated token of a chat choice (OpenAI's `ChatCompletionTokenLogprob`)."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[ChatTopLogprob]  # most likely first; empty with top_logprobs 0


class ChatLogprobs(msgspec.Struct, kw_only=True):
    """A chat choice's (or chunk's) `logprobs` (OpenAI's `ChoiceLogprobs`)."""

    content: list[ChatTokenLogprob]


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    """A completion choice's (or chunk's) `logprobs` (OpenAI's legacy `Logprobs`): four lists, one entry per
    token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]  # token -> logprob: the sampled token and the most likely alternatives
    text_offset: list[int]  # where each token's text starts in the choice's text


class LogprobsShaper:
    """Collects a request's `TokenLogprobs` and hands them out shaped, whole or chunk by chunk (`take`)."""

    def __init__(self, chat: bool, num_top: int, as_token_ids: bool = False) -> None:
        self.chat = chat
        self.num_top = num_top
        self.as_token_ids = as_token_ids
        self._pending: list[TokenLogprobs] = []
        self._text_offset = 0  # completions: where the next token's text starts in the output

    def add(self, logprobs: TokenLogprobs | None) -> None:
        if logprobs is not None:
            self._pending.append(logprobs)

    def take(self) -> ChatLogprobs | CompletionLogprobs | None:
        """The entries added since the last take, shaped; None when there are none."""
        if not self._pending:
            return None
        entries, self._pending = self._pending, []
        return self._chat(entries) if self.chat else self._completion(entries)

    def _chat(self, entries: list[TokenLogprobs]) -> ChatLogprobs:
        content = []
        for entry in entries:
            sampled = self._chat_top(entry.sampled)
            content.append(ChatTokenLogprob(token=sampled.token, logprob=sampled.logprob, bytes=sampled.bytes,
                                            top_logprobs=[self._chat_top(t) for t in entry.top[: self.num_top]]))
        return ChatLogprobs(content=content)

    def _completion(self, entries: list[TokenLogprobs]) -> CompletionLogprobs:
        shaped = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for entry in entries:
            token = self._token(entry.sampled)
            shaped.tokens.append(token)
            shaped.token_logprobs.append(_clamp(entry.sampled.logprob))
            top = {token: _clamp(entry.sampled.logprob)}
            for alternative in entry.top[: self.num_top]:
                top.setdefault(self._token(alternative), _clamp(alternative.logprob))
            shaped.top_logprobs.append(top)
            shaped.text_offset.append(self._text_offset)
            self._text_offset += len(entry.sampled.token)
        return shaped

    def _chat_top(self, token: TokenLogprob) -> ChatTopLogprob:
        shown = self._token(token)
        return ChatTopLogprob(token=shown, logprob=_clamp(token.logprob),
                              bytes=list(shown.encode("utf-8", errors="replace")))

    def _token(self, token: TokenLogprob) -> str:
        return f"token_id:{token.token_id}" if self.as_token_ids else token.token


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)
