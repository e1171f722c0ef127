"""Structured output: a JSON Schema compiled by llguidance into a per-request token mask.

llguidance (Microsoft's, in Rust; a structured-output backend of vLLM and llama.cpp) was chosen over xgrammar because
its wheel depends on nothing (xgrammar 0.2.8 pulls triton and apache-tvm-ffi), builds a tokenizer's token trie in
milliseconds, and computes each mask on the fly with no per-grammar precompilation; see docs/platform.md.

The gateway calls `check_json_schema` before anything is queued; the worker's engine holds one `GrammarCompiler`
(the tokenizer's token trie, built once) and gives each constrained request its own `GrammarMatcher`.
"""

from __future__ import annotations

import collections
import json
from typing import TYPE_CHECKING

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # in the stubs only

from lorafaas.errors import InvalidInput

# Compact JSON (no whitespace between tokens, `,` and `:` bare): a small model never loops on whitespace, and an
# output is one canonical text. The schema itself may still override this under its "x-guidance" key.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # response_format json_object: any JSON object
MAX_CACHED_GRAMMARS = 64


class SchemaRefused(InvalidInput):
    """A response_format schema that is malformed or uses what llguidance cannot enforce (a 4xx naming the field)."""

    code = "invalid_response_format"
    param = "response_format"  # OpenAI's error body names the parameter


def json_grammar(schema_text: str) -> str:
    """The llguidance grammar of a JSON Schema given as JSON text; raises SchemaRefused if it is not one."""
    try:
        schema = json.loads(schema_text)
    except json.JSONDecodeError as exc:
        raise SchemaRefused(f"response_format.json_schema.schema is not valid JSON: {exc}") from None
    except RecursionError:
        raise SchemaRefused("response_format.json_schema.schema is nested too deeply") from None
    if not isinstance(schema, dict):
        raise SchemaRefused(f"response_format.json_schema.schema must be a JSON object, got {type(schema).__name__}")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema_text, defaults=JSON_OPTIONS)
    except ValueError as exc:  # what Python's json reads but JSON does not (Infinity, a lone surrogate escape)
        raise SchemaRefused(f"response_format.json_schema.schema is not valid JSON: {exc}") from None


def check_json_schema(schema_text: str) -> None:
    """Raise InvalidInput naming the problem if llguidance cannot enforce this schema (a malformed schema, or a
    keyword it does not implement: refused, never ignored). Cheap: no tokenizer is involved."""
    problem = llguidance.LLMatcher.validate_grammar(json_grammar(schema_text))
    if problem:
        raise SchemaRefused(f"response_format.json_schema.schema cannot be enforced: {problem.strip()}")


class GrammarMatcher:
    """One request's position in its grammar: which tokens may come next, and whether the grammar is complete."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size  # the tokenizer's; the model's logits may be wider (padded vocabulary)

    def allowed_bitmask(self) -> bytes:
        """Bit i (little-endian, 32-bit words) set: token i may come next. The end-of-sequence token is allowed
        exactly when the grammar accepts what was generated so far."""
        return self._matcher.compute_bitmask()

    def accept(self, token_id: int) -> None:
        if not self._matcher.consume_token(token_id):
            raise ValueError(f"the grammar refused token {token_id}: {self._matcher.get_error()}")

    @property
    def is_complete(self) -> bool:
        """The grammar allows nothing more (the JSON value is closed): the request ends here."""
        return self._matcher.is_stopped()


class GrammarCompiler:
    """A worker's grammars: the tokenizer's llguidance view (built once, on the first constrained request) and each
    schema compiled once into a matcher that requests copy (bounded, least recently used out first)."""

    def __init__(self, tokenizer, eos_ids: frozenset[int], max_cached: int = MAX_CACHED_GRAMMARS) -> None:
        self._tokenizer = tokenizer
        self._eos_ids = eos_ids
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._compiled: collections.OrderedDict[str, llguidance.LLMatcher] = collections.OrderedDict()
        self._max_cached = max_cached

    def matcher(self, schema_text: str) -> GrammarMatcher:
        """A fresh matcher at the start of the schema's grammar; raises SchemaRefused for a schema it cannot enforce."""
        compiled = self._compiled.get(schema_text)
        if compiled is None:
            try:
                compiled = llguidance.LLMatcher(self._llguidance_tokenizer(), json_grammar(schema_text), log_level=0)
            except ValueError as exc:
                raise SchemaRefused(f"response_format.json_schema.schema cannot be enforced: {exc}") from None
            if compiled.is_error():
                raise SchemaRefused(f"response_format.json_schema.schema cannot be enforced: {compiled.get_error()}")
            self._compiled[schema_text] = compiled
            if len(self._compiled) > self._max_cached:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(schema_text)
        return GrammarMatcher(compiled.deep_copy(), self._llguidance_tokenizer().vocab_size)

    @property
    def num_cached(self) -> int:
        return len(self._compiled)

    def _llguidance_tokenizer(self) -> llguidance.LLTokenizer:
        if self._lltokenizer is None:
            import llguidance.hf  # imports transformers: the gateway, which only checks schemas, never needs it

            self._lltokenizer = llguidance.hf.from_tokenizer(self._tokenizer, eos_token=sorted(self._eos_ids) or None)
        return self._lltokenizer
