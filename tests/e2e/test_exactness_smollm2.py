"""Does a request get the tokens it gets alone, whatever else the node does? On the real smollm2-135m through real
workers, against the same request alone on one thread: on two threads (the step gate grants a step 1 or 2), in the
shared base pass, and batched there. Exact in float32, and in bf16 on two threads and alone in the pass; batched,
bf16 is asserted exactly as it is: a request's tokens equal alone's up to its first divergence, and there it takes
the other of alone's top two tokens, whose log-probabilities alone are under `BF16_NEAR_TIE_NATS` apart
(docs/performance.md, "Exactness of batched requests")."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from lorafaas.formats.backbone_dtype import convert_backbone
from lorafaas.function_runtime import messages as m
from lorafaas.platform.backends.local import LocalLauncher
from lorafaas.protocols.daemon_config import base_pass_socket
from tests.support.exactness import BF16_NEAR_TIE_NATS, exact_or_near_ties

ADAPTER = sorted(p for p in (Path(__file__).resolve().parents[2] / "examples" / "adapters").iterdir()
                 if (p / "adapter_config.json").is_file())[0]
PROMPTS = ["Tell me about the ocean.", "What do you like to do on weekends?", "Describe a forest at night.",
           "How do airplanes fly?"]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def launcher(smollm2_store):
    convert_backbone(smollm2_store, "smollm2-135m-bf16", "smollm2-135m", "bfloat16")
    with LocalLauncher(smollm2_store.models_dir.parent) as launcher:
        yield launcher


def request(request_id: str, prompt: str) -> m.Generate:
    return m.Generate(request_id=request_id, messages=(m.ChatMessage("user", prompt),),
                      params=m.SamplingParams(max_tokens=MAX_TOKENS, logprobs=2))


async def tokens(worker, req: m.Generate) -> list[m.Token]:
    return [event async for event in worker.generate(req) if isinstance(event, m.Token)]


def serve(launcher: LocalLauncher, backbone: str, *, threads: int = 1, shared_pass: bool = False,
          batched: bool = False) -> list[list[m.Token]]:
    """PROMPTS' tokens from one worker on `threads` (what a step gate grant sets), its backbone's products in the
    daemon's shared base pass or its own; one at a time, or all at once."""
    spec = launcher.spec(ADAPTER.name, backbone, ADAPTER, num_threads=threads)
    if shared_pass:  # no step gate: every step goes to the pass
        spec = msgspec.structs.replace(spec, base_pass=str(base_pass_socket(Path(spec.daemon_socket))))
    instance = launcher.launch(spec)

    async def scenario():
        async with await instance.connect() as worker:
            if batched:
                return list(await asyncio.gather(*(tokens(worker, request(f"r{i}", p)) for i, p in enumerate(PROMPTS))))
            return [await tokens(worker, request(f"r{i}", p)) for i, p in enumerate(PROMPTS)]

    try:
        return asyncio.run(scenario())
    finally:
        instance.kill()


def ids(replies: list[list[m.Token]]) -> list[list[int]]:
    return [[t.token_id for t in reply] for reply in replies]


@pytest.fixture(scope="module")
def alone(launcher):
    """Each backbone's PROMPTS alone on one thread, served once for the module."""
    served: dict[str, list[list[m.Token]]] = {}

    def tokens_alone(backbone: str) -> list[list[m.Token]]:
        if backbone not in served:
            served[backbone] = serve(launcher, backbone)
        return served[backbone]

    return tokens_alone


@pytest.mark.parametrize("backbone", ["smollm2-135m", "smollm2-135m-bf16"])
def test_tokens_do_not_depend_on_the_thread_grant_or_the_shared_pass(launcher, alone, backbone) -> None:
    expected = ids(alone(backbone))
    assert ids(serve(launcher, backbone, threads=2)) == expected
    assert ids(serve(launcher, backbone, shared_pass=True)) == expected


def test_float32_tokens_batched_in_the_shared_pass_equal_alone(launcher, alone) -> None:
    assert ids(serve(launcher, "smollm2-135m", shared_pass=True, batched=True)) == ids(alone("smollm2-135m"))


def test_bf16_tokens_batched_in_the_shared_pass_diverge_from_alone_only_at_near_ties(launcher, alone) -> None:
    exact, margins = exact_or_near_ties(PROMPTS, alone("smollm2-135m-bf16"),
                                        serve(launcher, "smollm2-135m-bf16", shared_pass=True, batched=True))
    assert all(margin < BF16_NEAR_TIE_NATS for margin in margins), f"no near-tie: {margins} nats"
    print(f"bf16, batched in the shared pass: {exact}/{len(PROMPTS)} exact; near-ties of {margins} nats")
