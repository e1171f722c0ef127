"""The generation engine: continuous batching gives each request exactly what it gets alone."""

import warnings

import pytest
import torch

from lorafaas.errors import InvalidInput, PromptTooLong
from lorafaas.function_runtime.engine import EngineConfig, GenerationEngine
from lorafaas.function_runtime.messages import SamplingParams
from lorafaas.models.lora import attach_adapter, read_host_adapter
from lorafaas.models.reference import load_backbone

PROMPTS = ["The quick brown fox", "Tell me about the ocean.", "Le chat dort", "Arr, matey!", "What is the capital"]


@pytest.fixture(scope="module")
def engine(tiny_store, tiny_adapter_dir) -> GenerationEngine:
    model, tokenizer = load_backbone(tiny_store.path("tiny-dense"))
    attach_adapter(model, read_host_adapter(tiny_adapter_dir))
    return GenerationEngine(model, tokenizer, EngineConfig(max_batch_size=4))


def run(engine: GenerationEngine, requests: dict[str, tuple[str, SamplingParams]], arrivals: dict | None = None):
    """Drive the engine until idle; `arrivals` maps a step number to request ids added before that step."""
    arrivals = arrivals or {0: list(requests)}
    streamed: dict[str, str] = {}
    tokens: dict[str, list[int]] = {}
    finished = {}
    step = 0
    while step <= max(arrivals) or engine.has_work():
        for rid in arrivals.get(step, []):
            prompt, params = requests[rid]
            engine.add(rid, engine.encode_chat([{"role": "user", "content": prompt}]), params)
        for out in engine.step():
            streamed[out.request_id] = streamed.get(out.request_id, "") + out.text
            if out.token_id is not None:
                tokens.setdefault(out.request_id, []).append(out.token_id)
            if out.finish_reason:
                finished[out.request_id] = out
        step += 1
    return finished, streamed, tokens


def test_batched_and_staggered_requests_equal_requests_served_alone(engine: GenerationEngine) -> None:
    params = SamplingParams(max_tokens=12)
    requests = {f"r{i}": (p, params) for i, p in enumerate(PROMPTS)}
    alone = {rid: run(engine, {rid: req})[2][rid] for rid, req in requests.items()}
    # Five requests, batch size 4, arriving at different steps: rows join and leave mid-flight.
    finished, streamed, tokens = run(engine, requests, arrivals={0: ["r0", "r1"], 2: ["r2"], 3: ["r3", "r4"]})
    assert tokens == alone
    for rid, out in finished.items():
        assert streamed[rid] == out.full_text
        assert out.completion_tokens == len(tokens[rid])  # a sampled EOS counts, as vLLM counts it


def test_max_tokens_ends_with_length(engine: GenerationEngine) -> None:
    finished, _, tokens = run(engine, {"a": ("The quick brown fox", SamplingParams(max_tokens=3))})
    assert finished["a"].finish_reason in ("length", "stop")
    assert len(tokens["a"]) <= 3
    if finished["a"].finish_reason == "length":
        assert finished["a"].completion_tokens == 3


def test_stop_string_cuts_the_text(engine: GenerationEngine) -> None:
    finished, streamed, _ = run(engine, {"a": ("The quick brown fox", SamplingParams(max_tokens=20))})
    full = finished["a"].full_text
    assert len(full) > 3, "the tiny model must produce some text for this test to mean anything"
    stop = full[2:4]
    finished, streamed, _ = run(engine, {"a": ("The quick brown fox", SamplingParams(max_tokens=20, stop=(stop,)))})
    assert finished["a"].finish_reason == "stop"
    assert finished["a"].full_text == full[: full.find(stop)]
    assert streamed["a"] == finished["a"].full_text


def test_seeded_sampling_is_reproducible_and_independent_of_batching(engine: GenerationEngine) -> None:
    sampled = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    alone = run(engine, {"s": ("Tell me about the ocean.", sampled)})[2]["s"]
    again = run(engine, {"s": ("Tell me about the ocean.", sampled),
                         "g": ("Le chat dort", SamplingParams(max_tokens=10))})[2]["s"]
    assert again == alone
    other_seed = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=8)
    assert run(engine, {"s": ("Tell me about the ocean.", other_seed)})[2]["s"] != alone


def test_cancel_ends_a_running_request_and_leaves_others(engine: GenerationEngine) -> None:
    params = SamplingParams(max_tokens=12)
    alone = run(engine, {"keep": ("Le chat dort", params)})[2]["keep"]
    engine.add("drop", engine.encode_text("The quick brown fox"), params)
    engine.add("keep", engine.encode_chat([{"role": "user", "content": "Le chat dort"}]), params)
    outputs = engine.step()
    engine.cancel("drop")
    outputs += [o for _ in range(40) for o in engine.step()]
    drop = [o for o in outputs if o.request_id == "drop" and o.finish_reason]
    assert [o.finish_reason for o in drop] == ["cancelled"]
    assert [o.token_id for o in outputs if o.request_id == "keep"] == alone
    assert not engine.has_work()


def test_prompt_over_the_context_window_is_refused(engine: GenerationEngine) -> None:
    with pytest.raises(PromptTooLong, match=rf"prompt has 300 tokens; the context window is {engine.max_context}"):
        engine.add("long", [5] * 300, SamplingParams())
    with pytest.raises(InvalidInput, match="max_tokens is 0"):
        engine.add("zero", [5], SamplingParams(max_tokens=0))
    assert not engine.has_work()


def test_max_tokens_asked_for_beyond_the_room_left_is_refused_a_default_is_cut_short(engine: GenerationEngine
                                                                                      ) -> None:
    prompt = [5] * (engine.max_context - 10)
    with pytest.raises(PromptTooLong, match=rf"prompt has {len(prompt)} tokens and max_tokens is 11: together they "
                                            rf"exceed the context window of {engine.max_context} tokens; ask for at "
                                            r"most 10, or omit max_tokens"):
        engine.add("asked", prompt, SamplingParams(max_tokens=11, max_tokens_exact=True))
    assert not engine.has_work()
    engine.add("fits", prompt, SamplingParams(max_tokens=10, max_tokens_exact=True, ignore_eos=True))
    engine.add("default", prompt, SamplingParams(max_tokens=50, ignore_eos=True))  # a default: cut at the end
    outputs = [o for _ in range(40) for o in engine.step()]
    generated = {rid: sum(1 for o in outputs if o.request_id == rid and o.token_id is not None)
                 for rid in ("fits", "default")}
    assert generated == {"fits": 10, "default": 10}
    assert not engine.has_work()


def test_top_p_keeps_only_the_nucleus() -> None:
    from lorafaas.function_runtime.sampling import next_token

    logits = torch.log(torch.tensor([0.6, 0.3, 0.05, 0.05]))
    params = SamplingParams(temperature=1.0, top_p=0.5)
    generator = torch.Generator().manual_seed(0)
    assert {next_token(logits, params, generator) for _ in range(50)} == {0}


def test_ignore_eos_generates_exactly_max_tokens_with_the_same_prefix(engine: GenerationEngine) -> None:
    prompt = "Tell me about the ocean."
    normal = run(engine, {"a": (prompt, SamplingParams(max_tokens=30))})[2]["a"]
    fixed = run(engine, {"a": (prompt, SamplingParams(max_tokens=30, ignore_eos=True))})[2]["a"]
    assert len(fixed) == 30
    stop = next((i for i, t in enumerate(normal) if t in engine.eos_ids), len(normal))
    assert fixed[:stop] == normal[:stop]


def test_requests_waiting_together_are_prefilled_in_one_pass_with_what_they_get_alone(engine: GenerationEngine) -> None:
    params = SamplingParams(max_tokens=6)
    prompts = {f"p{i}": (p, params) for i, p in enumerate(PROMPTS[:4])}  # prompts of different lengths: left padding
    alone = {rid: run(engine, {rid: req})[2][rid] for rid, req in prompts.items()}
    for rid, (prompt, p) in prompts.items():
        engine.add(rid, engine.encode_chat([{"role": "user", "content": prompt}]), p)
    firsts = [out for out in engine.step() if out.prefill_s is not None]
    assert sorted(out.request_id for out in firsts) == sorted(prompts)
    assert {out.prefill_batch for out in firsts} == {4} and len({out.prefill_s for out in firsts}) == 1
    tokens = {out.request_id: [out.token_id] for out in firsts}
    while engine.has_work():
        for out in engine.step():
            if out.token_id is not None:
                tokens[out.request_id].append(out.token_id)
    assert tokens == alone


def test_a_request_whose_sampling_fails_fails_alone(engine: GenerationEngine, monkeypatch) -> None:
    """Fault injection: the sampler raises for one request (seed 666), in prefill and mid-decode; its batch-mates get
    exactly what they get alone."""
    import lorafaas.function_runtime.engine as engine_module

    real = engine_module.next_token
    calls = {"n": 0}

    def flaky(logits, params, generator, *history):
        if params.seed == 666:
            calls["n"] += 1
            if calls["n"] >= 3:  # fails at its third token: mid-decode, beside the others
                raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
        return real(logits, params, generator, *history)

    greedy = SamplingParams(max_tokens=8)
    requests = {"a": (PROMPTS[0], greedy), "b": (PROMPTS[1], greedy),
                "bad": (PROMPTS[2], SamplingParams(max_tokens=8, temperature=1.0, seed=666))}
    alone = {rid: run(engine, {rid: requests[rid]})[2][rid] for rid in ("a", "b")}
    monkeypatch.setattr(engine_module, "next_token", flaky)
    finished, _, tokens = run(engine, requests)
    assert finished["bad"].finish_reason == "error" and "sampling failed" in finished["bad"].error
    assert len(tokens["bad"]) == 2
    assert {rid: tokens[rid] for rid in ("a", "b")} == alone
    assert not engine.has_work()


@pytest.mark.parametrize("params", [SamplingParams(temperature=1e-300), SamplingParams(temperature=1.0, top_p=1e-300)])
def test_degenerate_sampling_parameters_give_the_most_likely_token(params: SamplingParams) -> None:
    from lorafaas.function_runtime.sampling import new_generator, next_token

    logits = torch.tensor([0.1, 3.0, -2.0, 2.9])
    assert next_token(logits, params, new_generator(params)) == 1


def test_prefill_passes_stay_within_the_token_budget_and_chunks_give_the_same_tokens(tiny_store, tiny_adapter_dir
                                                                                     ) -> None:
    """Issue 18 item 4: eight near-context prompts were prefilled in one pass (memory grew with rows x width^2);
    now each pass holds at most max_prefill_tokens (rows x padded width), and a longer prompt goes in chunks."""
    model, tokenizer = load_backbone(tiny_store.path("tiny-dense"))
    attach_adapter(model, read_host_adapter(tiny_adapter_dir))
    long_prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 12)
    params = SamplingParams(max_tokens=6)
    requests = {f"r{i}": (long_prompt + f" {i}", params) for i in range(8)}
    unbounded = GenerationEngine(model, tokenizer, EngineConfig(max_batch_size=8, max_prefill_tokens=10**6))
    budget = 64
    bounded = GenerationEngine(model, tokenizer, EngineConfig(max_batch_size=8, max_prefill_tokens=budget))
    widths: list[tuple[int, int]] = []
    forward = model.forward

    def recording_forward(*args, **kwargs):
        ids = kwargs["input_ids"]
        if ids.shape[1] > 1:  # a prefill pass (decode steps feed one token per row)
            widths.append(tuple(ids.shape))
        return forward(*args, **kwargs)

    expected = run(unbounded, requests)[2]
    prompt_len = len(bounded.encode_chat([{"role": "user", "content": long_prompt + " 0"}]))
    assert prompt_len > budget, "the prompt must be longer than the budget to be chunked"
    model.forward = recording_forward
    try:
        got = run(bounded, requests)[2]
    finally:
        del model.forward
    assert got == expected
    assert widths and all(rows * width <= budget for rows, width in widths), widths


def test_penalties_top_k_bias_and_logprobs_batched_equal_alone(engine: GenerationEngine) -> None:
    """Per-request sampler state (its own prompt and output for the penalties, its generator) is never mixed with a
    batch-mate's: each of these samples the same tokens, with the same logprobs, batched as alone."""
    requests = {
        "penalized": (PROMPTS[0], SamplingParams(max_tokens=10, temperature=0.9, seed=11, top_k=8, min_p=0.05,
                                                 presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3,
                                                 logprobs=3)),
        "biased": (PROMPTS[1], SamplingParams(max_tokens=10, logit_bias={100: 5.0, 101: -100.0},
                                              repetition_penalty=2.0, logprobs=0)),
        "plain": (PROMPTS[2], SamplingParams(max_tokens=10, temperature=1.0, seed=5)),
        "top_k": (PROMPTS[3], SamplingParams(max_tokens=10, temperature=1.2, seed=2, top_k=3, top_p=0.9)),
    }

    alone = {rid: run(engine, {rid: req})[2][rid] for rid, req in requests.items()}
    _, _, batched = run(engine, requests, arrivals={0: ["penalized", "plain"], 2: ["biased"], 3: ["top_k"]})
    assert batched == alone
    unpenalized = run(engine, {"x": (PROMPTS[1], SamplingParams(max_tokens=10))})[2]["x"]
    assert alone["biased"] != unpenalized, "logit_bias and repetition_penalty changed nothing"


def test_logprobs_of_each_token_batched_equal_alone(engine: GenerationEngine) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=4, top_k=5, presence_penalty=1.0, logprobs=4)

    def logprobs_of(arrivals, requests):
        seen: dict[str, list] = {}
        arrivals = arrivals or {0: list(requests)}
        step = 0
        while step <= max(arrivals) or engine.has_work():
            for rid in arrivals.get(step, []):
                prompt, p = requests[rid]
                engine.add(rid, engine.encode_chat([{"role": "user", "content": prompt}]), p)
            for out in engine.step():
                if out.logprobs is not None:
                    seen.setdefault(out.request_id, []).append(out.logprobs)
            step += 1
        return seen

    requests = {"a": (PROMPTS[0], params), "b": (PROMPTS[4], SamplingParams(max_tokens=6))}
    alone = logprobs_of(None, {"a": requests["a"]})["a"]
    batched = logprobs_of({0: ["b"], 1: ["a"]}, requests)
    assert "b" not in batched, "logprobs only for the request that asked"
    assert [e.sampled.token_id for e in batched["a"]] == [e.sampled.token_id for e in alone]
    for got, want in zip(batched["a"], alone, strict=True):
        assert got.sampled.logprob == pytest.approx(want.sampled.logprob, abs=1e-4)
        assert [t.token_id for t in got.top] == [t.token_id for t in want.top]
        assert len(got.top) == 4 and got.top[0].logprob >= got.top[-1].logprob
        assert got.sampled.token == engine.tokenizer.decode([got.sampled.token_id])


def test_a_step_uses_no_deprecated_transformers_name(engine: GenerationEngine, caplog) -> None:
    """Every deprecation warning a step raises lands in the worker's log on every request (transformers 5.2x renamed
    `past_key_values` to `cache`; the engine must use the installed version's name)."""
    requests = {"a": ("The ocean is", SamplingParams(max_tokens=4)), "b": ("Arr", SamplingParams(max_tokens=3))}
    with warnings.catch_warnings(record=True) as caught, caplog.at_level("WARNING"):
        warnings.simplefilter("always")
        run(engine, requests, arrivals={0: ["a"], 1: ["b"]})  # a prefill, decode steps and a row joining
    deprecated = [str(w.message) for w in caught if "deprecat" in str(w.message).lower()]
    deprecated += [r.getMessage() for r in caplog.records if "deprecat" in r.getMessage().lower()]
    assert deprecated == []


def test_the_heap_goes_back_to_the_machine_each_time_the_batch_drains_and_only_then(tiny_store, tiny_adapter_dir
                                                                                     ) -> None:
    """A drained batch's KV cache and activations are freed, but glibc keeps the pages unless trimmed (an idle
    SmolLM2 worker held 96 MB that way): the engine releases free memory when its batch empties with nothing
    waiting, never while a sequence runs or waits."""
    model, tokenizer = load_backbone(tiny_store.path("tiny-dense"))
    attach_adapter(model, read_host_adapter(tiny_adapter_dir))
    released: list[tuple[int, int]] = []
    engine = GenerationEngine(model, tokenizer, EngineConfig(max_batch_size=4),
                              release_memory=lambda: released.append((engine.num_running, engine.num_waiting)))
    requests = {rid: (PROMPTS[i], SamplingParams(max_tokens=n, ignore_eos=True))
                for i, (rid, n) in enumerate([("a", 3), ("b", 6), ("c", 4)])}
    finished, _, _ = run(engine, requests, arrivals={0: ["a"], 2: ["b"], 20: ["c"]})
    assert sorted(finished) == ["a", "b", "c"]
    # a ends while b runs (no release); b ends alone (one); c, arriving later, ends alone (another)
    assert released == [(0, 0), (0, 0)]
