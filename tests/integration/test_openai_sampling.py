"""vLLM's sampling parameters and logprobs through a real platform, driven by the official `openai` client.

Every parameter is checked against plain transformers + PEFT on the same backbone and adapter (tiny-dense): the
logprobs within 1e-4, and greedy decoding with penalties and logit_bias token for token against a reference loop
that applies vLLM's formulas by hand.
"""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from lorafaas.formats.model_store import ModelStore
from lorafaas.models.reference import chat_template_ids, load_backbone, with_adapter
from lorafaas.testing.platform_process import PlatformProcess
from lorafaas.testing.tiny_models import save_tiny_adapter

FUNCTION = "sampler"
MESSAGES = [{"role": "user", "content": "Tell me about the ocean."}]
TOLERANCE = 1e-4
REFUSED = (openai.BadRequestError, openai.UnprocessableEntityError)  # 400 once the OpenAI routes answer as vLLM


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, tiny_dense_dir):
    return save_tiny_adapter(tmp_path_factory.mktemp("sampler-adapter"), tiny_dense_dir, seed=3,
                             base_model_name="tiny-dense")


@pytest.fixture(scope="module")
def platform(tmp_path_factory, tiny_dense_dir, adapter_dir):
    home = tmp_path_factory.mktemp("sampler-home")
    ModelStore(home / "models").import_dir("tiny-dense", tiny_dense_dir)
    with PlatformProcess(home) as running:
        with running.client() as admin:
            admin.deploy({"name": FUNCTION, "backbone": "tiny-dense"}, adapter_dir)
        yield running


@pytest.fixture(scope="module")
def client(platform) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{platform.url}/v1", api_key=platform.admin_key, max_retries=0)


class Reference:
    """Plain transformers + PEFT: the model's log-softmax at each position, and greedy decoding with vLLM's penalty
    and logit_bias formulas written out token by token."""

    def __init__(self, backbone_dir, adapter_dir) -> None:
        model, self.tokenizer = load_backbone(backbone_dir)
        self.model = with_adapter(model, adapter_dir)
        self.prompt_ids = chat_template_ids(self.tokenizer, MESSAGES)
        self.eos_id = self.tokenizer.eos_token_id

    @torch.inference_mode()
    def logprobs(self, output_ids: list[int]) -> torch.Tensor:
        """[len(output_ids), vocab]: the log-probabilities each output token was drawn from (teacher-forced)."""
        ids = torch.tensor([self.prompt_ids + output_ids])
        logits = self.model(input_ids=ids).logits[0, len(self.prompt_ids) - 1: -1]
        return torch.log_softmax(logits.float(), dim=-1)

    @torch.inference_mode()
    def greedy(self, max_tokens: int, presence=0.0, frequency=0.0, repetition=1.0, bias=None) -> list[int]:
        output: list[int] = []
        while len(output) < max_tokens:
            logits = self.model(input_ids=torch.tensor([self.prompt_ids + output])).logits[0, -1].float().tolist()
            for token_id, value in (bias or {}).items():
                logits[token_id] += value
            for token_id in range(len(logits)):
                if token_id in self.prompt_ids or token_id in output:
                    logits[token_id] = logits[token_id] / repetition if logits[token_id] > 0 \
                        else logits[token_id] * repetition
                count = output.count(token_id)
                logits[token_id] -= frequency * count + (presence if count else 0.0)
            output.append(max(range(len(logits)), key=logits.__getitem__))
            if output[-1] == self.eos_id:
                break
        return output


@pytest.fixture(scope="module")
def reference(tiny_dense_dir, adapter_dir) -> Reference:
    return Reference(tiny_dense_dir, adapter_dir)


def chat(client: openai.OpenAI, **params):
    return client.chat.completions.create(model=FUNCTION, messages=MESSAGES, **params)


def token_ids(content) -> list[int]:
    return [int(entry.token.removeprefix("token_id:")) for entry in content]


AS_IDS = {"return_tokens_as_token_ids": True}


def test_chat_logprobs_equal_transformers_peft(client, reference) -> None:
    reply = chat(client, max_tokens=10, temperature=0, logprobs=True, top_logprobs=5, extra_body=AS_IDS)
    content = reply.choices[0].logprobs.content
    ids = token_ids(content)
    assert ids == reference.greedy(10)
    want = reference.logprobs(ids)
    for position, entry in enumerate(content):
        assert entry.logprob == pytest.approx(float(want[position, ids[position]]), abs=TOLERANCE)
        top = torch.topk(want[position], 5)
        assert [int(t.token.removeprefix("token_id:")) for t in entry.top_logprobs] == top.indices.tolist()
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=TOLERANCE)
    # Shown as text: each token decoded alone, with its UTF-8 bytes (vLLM's shape).
    shown = chat(client, max_tokens=10, temperature=0, logprobs=True).choices[0].logprobs.content
    assert [e.token for e in shown] == [reference.tokenizer.decode([i]) for i in ids]
    assert all(e.bytes == list(e.token.encode()) and e.top_logprobs == [] for e in shown)
    assert [e.logprob for e in shown] == pytest.approx([e.logprob for e in content], abs=1e-6)


def test_sampled_penalized_logprobs_are_the_raw_model_logprobs(client, reference) -> None:
    """Bias, penalties, temperature and truncation shape the draw, not the reported logprobs (vLLM's raw_logprobs);
    the same seed gives the same tokens."""
    params = dict(max_tokens=12, temperature=0.8, seed=21, presence_penalty=0.6, frequency_penalty=0.4,
                  logit_bias={"7": 3.0, "9": -2.0}, logprobs=True, top_logprobs=2,
                  extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.2, **AS_IDS})
    first = chat(client, **params).choices[0].logprobs.content
    assert token_ids(chat(client, **params).choices[0].logprobs.content) == token_ids(first)
    ids = token_ids(first)
    want = reference.logprobs(ids)
    assert [e.logprob for e in first] == pytest.approx([float(want[p, i]) for p, i in enumerate(ids)], abs=TOLERANCE)


def test_penalties_and_logit_bias_follow_vllms_formulas(client, reference) -> None:
    plain = reference.greedy(12)
    cases = [
        dict(presence_penalty=2.0),
        dict(frequency_penalty=1.5),
        dict(extra_body={"repetition_penalty": 1.8}),
        dict(presence_penalty=0.5, frequency_penalty=0.5, logit_bias={str(plain[1]): -100, "42": 2.5},
             extra_body={"repetition_penalty": 1.3}),
    ]
    for case in cases:
        extra = case.pop("extra_body", {})
        content = chat(client, max_tokens=12, temperature=0, logprobs=True, extra_body={**extra, **AS_IDS},
                       **case).choices[0].logprobs.content
        want = reference.greedy(12, presence=case.get("presence_penalty", 0.0),
                                frequency=case.get("frequency_penalty", 0.0),
                                repetition=extra.get("repetition_penalty", 1.0),
                                bias={int(k): v for k, v in case.get("logit_bias", {}).items()})
        assert token_ids(content) == want, case | extra
        assert want != plain, f"{case | extra} changed nothing on this prompt: pick a stronger value"
    forced = chat(client, max_tokens=4, temperature=0, logit_bias={"42": 100}, logprobs=True, extra_body=AS_IDS)
    assert token_ids(forced.choices[0].logprobs.content) == [42] * 4


def test_top_k_and_min_p_truncate_the_draw(client, reference) -> None:
    greedy = reference.greedy(10)
    for truncation in ({"top_k": 1}, {"min_p": 1.0}):
        reply = chat(client, max_tokens=10, temperature=1.0, seed=5, logprobs=True, extra_body={**truncation, **AS_IDS})
        assert token_ids(reply.choices[0].logprobs.content) == greedy, truncation
    wide = chat(client, max_tokens=16, temperature=2.0, seed=8, logprobs=True, top_logprobs=3,
                extra_body={"top_k": 3, **AS_IDS}).choices[0].logprobs.content
    assert all(entry.token in {t.token for t in entry.top_logprobs} for entry in wide)
    unrestricted = chat(client, max_tokens=16, temperature=2.0, seed=8, logprobs=True, top_logprobs=3,
                        extra_body=AS_IDS).choices[0].logprobs.content
    assert not all(entry.token in {t.token for t in entry.top_logprobs} for entry in unrestricted)


def test_streamed_chat_logprobs_equal_the_whole_reply(client) -> None:
    whole = chat(client, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2).choices[0]
    chunks = list(chat(client, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2, stream=True))
    streamed = [entry for c in chunks if c.choices and c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole.logprobs.content]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.message.content


def test_completions_logprobs_and_echo(client, reference) -> None:
    no_eos = {str(reference.eos_id): -100}
    prompt = "The quick brown fox"
    reply = client.completions.create(model=FUNCTION, prompt=prompt, max_tokens=8, temperature=0, logprobs=3,
                                      logit_bias=no_eos, extra_body=AS_IDS).choices[0]
    shaped = reply.logprobs
    assert len(shaped.tokens) == len(shaped.token_logprobs) == len(shaped.top_logprobs) == 8
    ids = [int(t.removeprefix("token_id:")) for t in shaped.tokens]
    assert reference.tokenizer.decode(ids) == reply.text
    for token, logprob, top in zip(shaped.tokens, shaped.token_logprobs, shaped.top_logprobs, strict=True):
        assert 3 <= len(top) <= 4 and top[token] == logprob  # the sampled token and the 3 most likely ones
        assert max(top.values()) == logprob  # greedy: the sampled token is the most likely
    as_text = client.completions.create(model=FUNCTION, prompt=prompt, max_tokens=8, temperature=0, logprobs=0,
                                        logit_bias=no_eos).choices[0].logprobs
    assert as_text.text_offset == [sum(len(t) for t in as_text.tokens[:i]) for i in range(8)]
    assert all(len(top) == 1 for top in as_text.top_logprobs)
    stream = client.completions.create(model=FUNCTION, prompt=prompt, max_tokens=8, temperature=0, logprobs=3,
                                       logit_bias=no_eos, extra_body=AS_IDS, stream=True)
    assert [t for c in stream if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == shaped.tokens
    echoed = client.completions.create(model=FUNCTION, prompt=prompt, max_tokens=8, temperature=0, echo=True,
                                       logit_bias=no_eos).choices[0]
    assert echoed.text == prompt + reply.text
    streamed = client.completions.create(model=FUNCTION, prompt=prompt, max_tokens=8, temperature=0, echo=True,
                                         logit_bias=no_eos, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == prompt + reply.text


def test_native_invoke_takes_the_sampler_parameters(platform, reference) -> None:
    body = {"prompt": "The quick brown fox", "max_tokens": 3, "logit_bias": {"42": 100}, "top_k": 5, "min_p": 0.1,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
    reply = httpx.post(f"{platform.url}/v1/functions/{FUNCTION}/invoke", json=body, timeout=120,
                       headers={"Authorization": f"Bearer {platform.admin_key}"})
    assert reply.status_code == 200, reply.text
    assert reply.json()["text"] == reference.tokenizer.decode([42] * 3)


@pytest.mark.parametrize(("params", "field"), [
    (dict(extra_body={"top_k": -2}), "top_k"),
    (dict(extra_body={"min_p": 1.5}), "min_p"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    (dict(logit_bias={"5": 101}), "logit_bias"),
    (dict(logit_bias={"five": 1}), "logit_bias"),
    (dict(logit_bias={"100000": 1}), "logit_bias"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(top_logprobs=2), "top_logprobs"),
])
def test_bad_sampler_values_are_refused_naming_the_field(client, params, field) -> None:
    with pytest.raises(REFUSED) as refused:
        chat(client, max_tokens=2, **params)
    assert field in str(refused.value)


@pytest.mark.parametrize(("params", "field"), [
    (dict(logprobs=6), "logprobs"),
    (dict(logprobs=1, echo=True), "echo"),
])
def test_bad_completion_values_are_refused_naming_the_field(client, params, field) -> None:
    with pytest.raises(REFUSED) as refused:
        client.completions.create(model=FUNCTION, prompt="hi", max_tokens=2, **params)
    assert field in str(refused.value)
