"""Structured output in the sampler: the grammar's mask decides which tokens may be drawn, and nothing else changes.

The mask tests use hand-made logits and masks; the grammar tests run llguidance on the tiny backbone's real
byte-level BPE tokenizer and the engine on the tiny model, and parse every output against its schema.
"""

import json

import jsonschema
import pytest
import torch

from lorafaas.function_runtime.engine import EngineConfig, GenerationEngine
from lorafaas.function_runtime.grammar import GrammarCompiler, SchemaRefused, check_json_schema
from lorafaas.function_runtime.messages import SamplingParams
from lorafaas.function_runtime.sampling import allowed_from_bitmask, new_generator, next_token
from lorafaas.models.reference import load_backbone

VOCAB = 64
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 18, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
COLOURS = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}


def bitmask_of(ids: set[int], num_bits: int) -> bytes:
    """The llguidance layout written out by hand: bit i of little-endian 32-bit words."""
    words = [0] * ((num_bits + 31) // 32)
    for i in ids:
        words[i // 32] |= 1 << (i % 32)
    return b"".join(w.to_bytes(4, "little") for w in words)


def test_bitmask_decodes_to_exactly_the_allowed_ids_and_a_padded_vocabulary_is_masked() -> None:
    ids = {0, 5, 31, 32, 40, 63}
    assert set(allowed_from_bitmask(bitmask_of(ids, 64), 64).nonzero().flatten().tolist()) == ids
    # The model's logits are wider than the tokenizer's vocabulary: the extra rows are never allowed.
    wider = allowed_from_bitmask(bitmask_of(ids, 64), 100)
    assert wider.shape == (100,) and set(wider.nonzero().flatten().tolist()) == ids


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=1),
    SamplingParams(temperature=1.5, top_p=0.9, seed=2),
    SamplingParams(temperature=1.0, top_k=5, min_p=0.01, seed=3),
    SamplingParams(temperature=1.0, logit_bias={7: 100.0}, presence_penalty=-2.0, seed=4),
], ids=["plain", "top_p", "top_k_min_p", "bias_on_a_masked_token"])
def test_a_masked_token_is_never_sampled(params) -> None:
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    allowed_ids = {3, 11, 20, 41}
    logits[7] = 50.0  # by far the most likely token, and masked
    allowed = allowed_from_bitmask(bitmask_of(allowed_ids, VOCAB), VOCAB)
    generator = new_generator(params)
    drawn = {next_token(logits, params, generator, [1, 2], [7, 7], allowed) for _ in range(500)}
    assert drawn <= allowed_ids
    assert len(drawn) > 1, "the draw must still be random among the allowed tokens"


def test_greedy_picks_the_best_allowed_token_after_bias_and_penalties() -> None:
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    allowed_ids = {2, 9, 30, 50}
    allowed = allowed_from_bitmask(bitmask_of(allowed_ids, VOCAB), VOCAB)
    params = SamplingParams(logit_bias={30: 7.5}, repetition_penalty=1.3)
    adjusted = logits.clone()
    adjusted[30] += 7.5
    seen = {9}
    for i in seen:
        adjusted[i] = adjusted[i] / 1.3 if adjusted[i] > 0 else adjusted[i] * 1.3
    best = max(allowed_ids, key=lambda i: float(adjusted[i]))
    assert next_token(logits, params, None, [9], [], allowed) == best
    assert next_token(logits, SamplingParams(), None, [], [], None) == int(torch.argmax(logits))


@pytest.fixture(scope="module")
def engine(tiny_store) -> GenerationEngine:
    model, tokenizer = load_backbone(tiny_store.path("tiny-dense"))
    return GenerationEngine(model, tokenizer, EngineConfig(max_batch_size=4))


def run(engine: GenerationEngine, requests: dict[str, SamplingParams]):
    for rid, params in requests.items():
        engine.add(rid, engine.encode_chat([{"role": "user", "content": f"Describe {rid}."}]), params)
    finished, tokens = {}, {}
    while engine.has_work():
        for out in engine.step():
            if out.token_id is not None:
                tokens.setdefault(out.request_id, []).append(out.token_id)
            if out.finish_reason:
                finished[out.request_id] = out
    return finished, tokens


@pytest.mark.parametrize("schema", [PERSON, COLOURS], ids=["object", "enum_array"])
@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 5), (1.0, 6)])
def test_every_output_matches_its_schema_and_ends_when_the_grammar_is_complete(engine, schema, temperature,
                                                                                 seed) -> None:
    params = SamplingParams(max_tokens=120, temperature=temperature, seed=seed, json_schema=json.dumps(schema))
    finished, tokens = run(engine, {"r": params})
    out = finished["r"]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.full_text), schema)
    # It stopped at the closing bracket, without spending a step on end-of-sequence.
    assert out.full_text.endswith(("}", "]")) and tokens["r"][-1] not in engine.eos_ids


def test_max_tokens_before_the_grammar_completes_is_length(engine) -> None:
    params = SamplingParams(max_tokens=4, json_schema=json.dumps(PERSON))
    out = run(engine, {"r": params})[0]["r"]
    assert out.finish_reason == "length" and out.completion_tokens == 4
    text = out.full_text
    assert '{"name":"'.startswith(text) or text.startswith('{"name":"'), "cut inside the schema's first property"
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_constrained_rows_batched_with_free_rows_leave_them_unchanged(engine) -> None:
    free = {"a": SamplingParams(max_tokens=12), "b": SamplingParams(max_tokens=12, temperature=1.0, seed=9)}
    constrained = {"c": SamplingParams(max_tokens=60, temperature=1.0, seed=4, json_schema=json.dumps(COLOURS)),
                   "d": SamplingParams(max_tokens=60, json_schema=json.dumps(PERSON))}
    alone = {rid: run(engine, {rid: params})[1][rid] for rid, params in (free | constrained).items()}
    finished, together = run(engine, free | constrained)
    assert together == alone
    jsonschema.validate(json.loads(finished["c"].full_text), COLOURS)
    jsonschema.validate(json.loads(finished["d"].full_text), PERSON)


def test_compiled_grammars_are_cached_per_schema_and_bounded(engine) -> None:
    compiler = GrammarCompiler(engine.tokenizer, engine.eos_ids, max_cached=2)
    for schema in (PERSON, COLOURS, PERSON, {"type": "integer"}):
        compiler.matcher(json.dumps(schema))
    assert compiler.num_cached == 2
    first, second = compiler.matcher(json.dumps(COLOURS)), compiler.matcher(json.dumps(COLOURS))
    first.accept(engine.tokenizer.encode("[", add_special_tokens=False)[0])
    assert first.allowed_bitmask() != second.allowed_bitmask(), "each request has its own grammar state"


@pytest.mark.parametrize("schema_text, says", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"type": "foo"}', "foo"),
    ('{"type": "integer", "minimum": Infinity}', "not valid JSON"),  # Python's json reads it, JSON does not
    ('{"properties": {"a": ' * 600 + "{}" + "}}" * 600, "nested too deeply"),
    ('{"type": "integer", "minimum": 5, "maximum": 1}', "Unsatisfiable"),
], ids=["malformed", "not_an_object", "unknown_type", "infinity", "too_deep", "unsatisfiable"])
def test_a_schema_that_cannot_be_enforced_is_refused_naming_response_format(engine, schema_text, says) -> None:
    with pytest.raises(SchemaRefused, match=says) as refused:
        check_json_schema(schema_text)
    assert "response_format" in str(refused.value) and refused.value.param == "response_format"
    with pytest.raises(SchemaRefused):
        engine.add("bad", [1, 2, 3], SamplingParams(json_schema=schema_text))
    assert not engine.has_work(), "nothing is queued"
