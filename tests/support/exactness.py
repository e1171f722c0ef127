"""Batched against alone, token for token: where a request's greedy tokens may differ from its tokens alone, and by
how much (docs/performance.md, "Exactness of batched requests")."""

from __future__ import annotations

from collections.abc import Sequence

from lorafaas.function_runtime import messages as m

# In bf16 a product's rounding depends on the rows beside it (other kernels' blocking than alone), so logits move
# within bf16 rounding and a greedy choice between two near-equal tokens can flip. Measured: 0.0 and 0.06 nats.
BF16_NEAR_TIE_NATS = 0.25


def exact_or_near_ties(prompts: Sequence[str], alone: Sequence[list[m.Token]],
                       other: Sequence[list[m.Token]]) -> tuple[int, list[float]]:
    """How many of `other` equal alone token for token, and alone's top-two margin (nats) where each other diverges;
    fails where one diverges to a token outside alone's top two (alone must be served with `logprobs=2`)."""
    exact, margins = 0, []
    for prompt, solo, seen in zip(prompts, alone, other, strict=True):
        ids, other_ids = [t.token_id for t in solo], [t.token_id for t in seen]
        if ids == other_ids:
            exact += 1
            continue
        at = next(i for i, (a, b) in enumerate(zip(ids, other_ids, strict=False)) if a != b)
        logprobs = solo[at].logprobs
        assert logprobs is not None, "alone was served without logprobs"
        alone_lp = {t.token_id: t.logprob for t in logprobs.top}  # alone's top two at the divergence
        assert other_ids[at] in alone_lp, f"{prompt!r}: at token {at} it took neither of alone's top two"
        margins.append(round(logprobs.sampled.logprob - alone_lp[other_ids[at]], 4))
    return exact, margins
