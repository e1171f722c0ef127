"""The function runtime on the real smollm2-135m with the demo adapters, through real worker processes."""

import asyncio
from pathlib import Path

import pytest
import torch

from lorafaas.function_runtime import messages as m
from lorafaas.models.lora import attach_adapter, detach_adapter, read_host_adapter
from lorafaas.models.reference import chat_input_ids, greedy_generate, load_backbone, with_adapter
from lorafaas.platform.backends.local import LocalLauncher
from tests.support.exactness import BF16_NEAR_TIE_NATS, exact_or_near_ties

DEMO_ADAPTERS = sorted(
    p for p in (Path(__file__).resolve().parents[2] / "examples" / "adapters").iterdir()
    if (p / "adapter_config.json").is_file()
)
PROMPTS = ["Tell me about the ocean.", "What do you like to do on weekends?"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def launcher(smollm2_store):
    with LocalLauncher(smollm2_store.models_dir.parent) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def merged_references(smollm2_store) -> dict[tuple[str, str], list[int]]:
    """Greedy tokens of PEFT's merged model (adapter folded into a private copy of the weights)."""
    references = {}
    for adapter in DEMO_ADAPTERS:
        model, tokenizer = load_backbone(smollm2_store.path("smollm2-135m"))
        merged = with_adapter(model, adapter).merge_and_unload()
        for prompt in PROMPTS:
            references[adapter.name, prompt] = greedy_generate(merged, tokenizer, prompt, MAX_TOKENS).token_ids
    return references


def chat(request_id: str, prompt: str, max_tokens: int = MAX_TOKENS) -> m.Generate:
    return m.Generate(request_id=request_id, messages=(m.ChatMessage("user", prompt),),
                      params=m.SamplingParams(max_tokens=max_tokens))


async def token_ids(worker, request: m.Generate) -> list[int]:
    return [event.token_id async for event in worker.generate(request) if isinstance(event, m.Token)]


def test_there_are_three_demo_adapters() -> None:
    assert len(DEMO_ADAPTERS) == 3


def served_greedy(launcher, backbone: str) -> dict[tuple[str, str], list[int]]:
    """Every demo adapter's greedy tokens for every prompt, each adapter in a real worker on `backbone`."""
    instances = {a.name: launcher.launch(launcher.spec(a.name, backbone, a)) for a in DEMO_ADAPTERS}

    async def serve_all():
        outputs = {}
        for name, instance in instances.items():
            async with await instance.connect() as worker:
                for i, prompt in enumerate(PROMPTS):
                    outputs[name, prompt] = await token_ids(worker, chat(f"{name}-{backbone}-{i}", prompt))
        return outputs

    return asyncio.run(serve_all())


def test_every_demo_adapter_through_the_runtime_equals_peft_merged(launcher, merged_references) -> None:
    outputs = served_greedy(launcher, "smollm2-135m")
    assert outputs == merged_references
    assert len({tuple(v) for v in outputs.values()}) == len(outputs), "every function answers differently"


@pytest.mark.parametrize("kernel", ["torch", "onednn"])
def test_either_float32_kernel_gives_peft_merged_greedy_tokens(tmp_path_factory, smollm2_store, merged_references,
                                                              monkeypatch, kernel) -> None:
    """The daemon's measured choice of kernel (lorafaas/models/cpu_linear.py) picks one per machine; both must answer
    as PEFT does. Each set for a daemon of its own home (the store's models, linked)."""
    home = tmp_path_factory.mktemp("k")  # short: the daemon's socket path must fit in sun_path
    (home / "models").symlink_to(smollm2_store.models_dir)
    monkeypatch.setenv("LORAFAAS_CPU_LINEAR", kernel)
    with LocalLauncher(home) as launcher:
        outputs = served_greedy(launcher, "smollm2-135m")
        daemon_log = (launcher.log_dir / "daemon-smollm2-135m.log").read_text()
    assert f"float32 products by {kernel} ({kernel}: set)" in daemon_log
    assert outputs == merged_references


def test_unmerged_logits_agree_with_peft_merged(smollm2_store) -> None:
    model, tokenizer = load_backbone(smollm2_store.path("smollm2-135m"))
    ids = torch.tensor([chat_input_ids(tokenizer, PROMPTS[0])])
    for adapter in DEMO_ADAPTERS:
        attach_adapter(model, read_host_adapter(adapter))
        with torch.inference_mode():
            ours = model(ids).logits
        detach_adapter(model)
        reference_model, _ = load_backbone(smollm2_store.path("smollm2-135m"))
        merged = with_adapter(reference_model, adapter).merge_and_unload()
        with torch.inference_mode():
            reference = merged(ids).logits
        relative = ((ours - reference).abs().max() / reference.abs().max()).item()
        assert relative < 1e-4, f"{adapter.name}: relative logit difference {relative:.2e}"


def test_two_functions_interleaved_and_eight_concurrent_requests_equal_alone(launcher) -> None:
    first, second = DEMO_ADAPTERS[0], DEMO_ADAPTERS[1]
    a = launcher.launch(launcher.spec(first.name, "smollm2-135m", first))
    b = launcher.launch(launcher.spec(second.name, "smollm2-135m", second))
    prompts = [*PROMPTS, "Describe a forest at night.", "How do airplanes fly?", "Why is the sky blue?",
               "Give me a recipe for pancakes.", "Explain how a rainbow forms.", "Tell me about the moon."]

    async def scenario():
        async with await a.connect() as wa, await b.connect() as wb:
            alone = {}
            for name, worker in ((first.name, wa), (second.name, wb)):
                for i, prompt in enumerate(prompts if name == first.name else PROMPTS):
                    alone[name, prompt] = await token_ids(worker, chat(f"alone-{name}-{i}", prompt, 16))
            jobs = {(first.name, p): token_ids(wa, chat(f"a-{i}", p, 16)) for i, p in enumerate(prompts)}
            jobs |= {(second.name, p): token_ids(wb, chat(f"b-{i}", p, 16)) for i, p in enumerate(PROMPTS)}
            together = dict(zip(jobs, await asyncio.gather(*jobs.values()), strict=True))
            return alone, together

    alone, together = asyncio.run(scenario())
    assert together == alone


def test_a_bf16_copy_of_the_backbone_through_the_runtime_equals_peft_in_bf16(launcher, smollm2_store) -> None:
    """The bf16 option (`backbone convert --dtype bfloat16`): every demo adapter's greedy tokens through a real worker
    on the copy equal PEFT's (unmerged) on the same bf16 weights."""
    from lorafaas.formats.backbone_dtype import convert_backbone

    manifest, _ = convert_backbone(smollm2_store, "smollm2-135m-bf16", "smollm2-135m", "bfloat16")
    assert manifest.dtypes == ("BF16",)
    references = {}
    for adapter in DEMO_ADAPTERS:
        model, tokenizer = load_backbone(smollm2_store.path("smollm2-135m-bf16"), dtype="bfloat16")
        peft_model = with_adapter(model, adapter)
        for prompt in PROMPTS:
            references[adapter.name, prompt] = greedy_generate(peft_model, tokenizer, prompt, MAX_TOKENS).token_ids
    assert served_greedy(launcher, "smollm2-135m-bf16") == references


def test_bf16_batched_requests_diverge_from_alone_only_at_near_ties(launcher, smollm2_store) -> None:
    from lorafaas.formats.backbone_dtype import convert_backbone

    convert_backbone(smollm2_store, "smollm2-135m-bf16", "smollm2-135m", "bfloat16")
    adapter = DEMO_ADAPTERS[0]
    instance = launcher.launch(launcher.spec(adapter.name, "smollm2-135m-bf16", adapter))
    prompts = [*PROMPTS, "Describe a forest at night.", "How do airplanes fly?", "Why is the sky blue?",
               "Give me a recipe for pancakes.", "Explain how a rainbow forms.", "Tell me about the moon."]

    def request(request_id: str, prompt: str) -> m.Generate:
        return m.Generate(request_id=request_id, messages=(m.ChatMessage("user", prompt),),
                          params=m.SamplingParams(max_tokens=16, logprobs=2))

    async def tokens(worker, req: m.Generate) -> list[m.Token]:
        return [event async for event in worker.generate(req) if isinstance(event, m.Token)]

    async def scenario():
        async with await instance.connect() as worker:
            alone = [await tokens(worker, request(f"alone-{i}", p)) for i, p in enumerate(prompts)]
            together = await asyncio.gather(*(tokens(worker, request(f"batch-{i}", p)) for i, p in enumerate(prompts)))
            return alone, together

    alone, together = asyncio.run(scenario())
    exact, margins = exact_or_near_ties(prompts, alone, together)
    assert all(margin < BF16_NEAR_TIE_NATS for margin in margins), f"no near-tie: {margins} nats"
    print(f"bf16, 8 concurrent: {exact}/{len(prompts)} exact; divergences at near-ties of {margins} nats")
