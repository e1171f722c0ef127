"""Each sampling parameter against a plain-torch reference written from vLLM's definitions, on the same logits.

The references are deliberately naive (loops over the vocabulary, sorting by hand) so they share no code with
`lorafaas.function_runtime.sampling`.
"""

import math
import re

import pytest
import torch

from lorafaas.errors import InvalidInput
from lorafaas.function_runtime.messages import SamplingParams
from lorafaas.function_runtime.sampling import (
    new_generator,
    next_token,
    processed_logits,
    sampling_probs,
    token_logprobs,
)

VOCAB = 64


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(7)) * 3


PROMPT = [1, 2, 3, 3, 9]
OUTPUT = [4, 4, 4, 9, 10, 2]


def reference_penalized(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]):
    """vLLM's apply_penalties (and HF's RepetitionPenaltyLogitsProcessor) token by token, after logit_bias."""
    out = [float(x) for x in logits]
    for token_id, bias in params.logit_bias.items():
        out[token_id] += bias
    for token_id in range(len(out)):
        if token_id in prompt or token_id in output:
            r = params.repetition_penalty
            out[token_id] = out[token_id] / r if out[token_id] > 0 else out[token_id] * r
        count = output.count(token_id)
        out[token_id] -= params.frequency_penalty * count
        if count:
            out[token_id] -= params.presence_penalty
    return torch.tensor(out)


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, min_p, top_k, top_p by hand: each keeps a set of token ids; the rest get probability 0."""
    values = [float(x) / params.temperature for x in logits]
    kept = set(range(len(values)))

    def softmax_over(ids):
        top = max(values[i] for i in ids)
        weights = {i: math.exp(values[i] - top) for i in ids}
        total = sum(weights.values())
        return {i: w / total for i, w in weights.items()}

    if params.min_p > 0:
        probs = softmax_over(kept)
        best = max(probs.values())
        kept = {i for i in kept if probs[i] >= params.min_p * best}
    if params.top_k > 0:
        ranked = sorted(kept, key=lambda i: -values[i])
        kth = values[ranked[min(params.top_k, len(ranked)) - 1]]
        kept = {i for i in kept if values[i] >= kth}
    if params.top_p < 1:
        probs = softmax_over(kept)
        nucleus, total = set(), 0.0
        for i in sorted(kept, key=lambda i: -probs[i]):
            if total >= params.top_p:
                break
            nucleus.add(i)
            total += probs[i]
        kept = nucleus
    probs = softmax_over(kept)
    return torch.tensor([probs.get(i, 0.0) for i in range(len(values))])


@pytest.mark.parametrize("params", [
    SamplingParams(logit_bias={5: 100.0, 6: -100.0, 7: 0.5}),
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(repetition_penalty=0.6),
    SamplingParams(frequency_penalty=0.7),
    SamplingParams(presence_penalty=-1.5),
    SamplingParams(presence_penalty=1.0, frequency_penalty=-0.5, repetition_penalty=1.3, logit_bias={4: -3.0}),
], ids=["logit_bias", "repetition>1", "repetition<1", "frequency", "presence", "all"])
def test_bias_and_penalties_equal_the_reference(logits, params) -> None:
    got = processed_logits(logits, params, PROMPT, OUTPUT)
    torch.testing.assert_close(got, reference_penalized(logits, params, PROMPT, OUTPUT), rtol=0, atol=1e-5)
    assert not torch.equal(got, logits.float()), "the parameter changed nothing"
    # Greedy decoding takes the argmax of the processed logits, as vLLM's does.
    assert next_token(logits, params, None, PROMPT, OUTPUT) == int(torch.argmax(got))


def test_logit_bias_steers_greedy_decoding(logits) -> None:
    assert next_token(logits, SamplingParams(logit_bias={11: 100.0}), None) == 11
    banned = int(torch.argmax(logits))
    assert next_token(logits, SamplingParams(logit_bias={banned: -100.0}), None) != banned


def test_penalties_look_at_output_and_repetition_at_the_prompt_too(logits) -> None:
    """presence/frequency see only generated tokens; repetition sees the prompt as well (vLLM, HF)."""
    only_prompt = [int(torch.argmax(logits))]
    assert torch.equal(processed_logits(logits, SamplingParams(presence_penalty=2.0), only_prompt, []),
                       logits.float())
    penalized = processed_logits(logits, SamplingParams(repetition_penalty=2.0), only_prompt, [])
    assert penalized[only_prompt[0]] < logits[only_prompt[0]]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.3, min_p=0.1),
    SamplingParams(temperature=1.0, min_p=0.05, top_k=10),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.02, top_k=30, top_p=0.8),
], ids=["top_k", "top_k=1", "min_p", "min_p+top_k", "top_k+top_p", "all"])
def test_truncation_equals_the_reference_distribution(logits, params) -> None:
    got = sampling_probs(logits.float(), params)
    want = reference_probs(logits, params)
    torch.testing.assert_close(got, want.float(), rtol=0, atol=1e-6)
    support = set(torch.nonzero(want).flatten().tolist())
    assert len(support) < VOCAB
    generator = new_generator(SamplingParams(temperature=1.0, seed=3))
    drawn = {next_token(logits, params, generator) for _ in range(200)}
    assert drawn <= support and (len(support) == 1 or len(drawn) > 1)


@pytest.mark.parametrize("top_k", [0, -1, VOCAB, VOCAB + 5])
def test_top_k_off_or_above_the_vocabulary_changes_nothing(logits, top_k) -> None:
    plain = sampling_probs(logits.float(), SamplingParams(temperature=1.0))
    torch.testing.assert_close(sampling_probs(logits.float(), SamplingParams(temperature=1.0, top_k=top_k)), plain)


def test_min_p_is_relative_to_the_most_likely_token() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.12, 0.08]))
    probs = sampling_probs(logits, SamplingParams(temperature=1.0, min_p=0.2))  # keeps p >= 0.1
    assert (probs > 0).tolist() == [True, True, True, False]
    torch.testing.assert_close(probs[:3].sum(), torch.tensor(1.0))


def test_logprobs_are_the_log_softmax_of_the_raw_logits(logits) -> None:
    sampled, top = token_logprobs(logits, 17, 5)
    reference = [float(x) - math.log(sum(math.exp(float(y)) for y in logits)) for x in logits]
    assert sampled == pytest.approx(reference[17], abs=1e-5)
    best = sorted(range(VOCAB), key=lambda i: -reference[i])[:5]
    assert [i for i, _ in top] == best
    assert [lp for _, lp in top] == pytest.approx([reference[i] for i in best], abs=1e-5)
    assert token_logprobs(logits, 17, 0) == (pytest.approx(reference[17], abs=1e-5), [])


@pytest.mark.parametrize(("params", "field"), [
    (SamplingParams(top_k=-2), "top_k"),
    (SamplingParams(min_p=1.5), "min_p"),
    (SamplingParams(presence_penalty=2.5), "presence_penalty"),
    (SamplingParams(frequency_penalty=-3.0), "frequency_penalty"),
    (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
    (SamplingParams(logit_bias={3: 101.0}), "logit_bias[3]"),
    (SamplingParams(logprobs=21), "logprobs"),
])
def test_out_of_range_values_are_refused_by_name(params, field) -> None:
    with pytest.raises(InvalidInput, match=rf"^{re.escape(field)} is"):
        params.check(4096)


def test_logit_bias_outside_the_vocabulary_is_refused() -> None:
    with pytest.raises(InvalidInput, match="logit_bias names token ids \\[512\\]"):
        SamplingParams(logit_bias={512: 1.0}).check_vocab(512)
    SamplingParams(logit_bias={511: 1.0}).check_vocab(512)
