"""Logprobs and the sampler parameters on the real smollm2-135m with a demo adapter, through `lorafaas up` and the
official openai client, against plain transformers + PEFT (unmerged) within 1e-4."""

from pathlib import Path

import openai
import pytest
import torch

from lorafaas.formats.model_store import ModelStore
from lorafaas.models.reference import chat_template_ids, load_backbone, with_adapter
from lorafaas.testing.platform_process import PlatformProcess

ADAPTER = Path(__file__).resolve().parents[2] / "examples" / "adapters" / "pirate"
MESSAGES = [{"role": "user", "content": "Tell me about the ocean."}]
AS_IDS = {"return_tokens_as_token_ids": True}


@pytest.fixture(scope="module")
def client(tmp_path_factory, smollm2_store):
    home = tmp_path_factory.mktemp("logprobs-home")
    ModelStore(home / "models").import_dir("smollm2-135m", smollm2_store.path("smollm2-135m"))
    with PlatformProcess(home) as running:
        with running.client() as admin:
            admin.deploy({"name": "pirate", "backbone": "smollm2-135m"}, ADAPTER)
        yield openai.OpenAI(base_url=f"{running.url}/v1", api_key=running.admin_key, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def reference(smollm2_store):
    model, tokenizer = load_backbone(smollm2_store.path("smollm2-135m"))
    peft_model = with_adapter(model, ADAPTER)
    prompt_ids = chat_template_ids(tokenizer, MESSAGES)

    @torch.inference_mode()
    def logprobs(output_ids: list[int]) -> torch.Tensor:
        logits = peft_model(input_ids=torch.tensor([prompt_ids + output_ids])).logits[0, len(prompt_ids) - 1: -1]
        return torch.log_softmax(logits.float(), dim=-1)

    return logprobs


def ids_of(content) -> list[int]:
    return [int(entry.token.removeprefix("token_id:")) for entry in content]


@pytest.mark.parametrize("params", [
    dict(temperature=0, top_logprobs=5),
    dict(temperature=0.9, seed=3, top_logprobs=3, presence_penalty=0.8, frequency_penalty=0.3,
         logit_bias={"198": -5.0}, extra_body={"top_k": 40, "min_p": 0.02, "repetition_penalty": 1.2, **AS_IDS}),
], ids=["greedy", "sampled-penalized"])
def test_logprobs_equal_transformers_peft(client, reference, params) -> None:
    extra = params.pop("extra_body", AS_IDS)
    reply = client.chat.completions.create(model="pirate", messages=MESSAGES, max_tokens=16, logprobs=True,
                                           extra_body=extra, **params)
    content = reply.choices[0].logprobs.content
    ids = ids_of(content)
    want = reference(ids)
    assert [e.logprob for e in content] == pytest.approx([float(want[p, i]) for p, i in enumerate(ids)], abs=1e-4)
    for position, entry in enumerate(content):
        top = torch.topk(want[position], len(entry.top_logprobs))
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
    if params["temperature"] == 0:
        assert all(entry.token == entry.top_logprobs[0].token for entry in content)
