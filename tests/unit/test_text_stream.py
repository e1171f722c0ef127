"""Streamed text: the incremental decoder (tokenizers' DecodeStream, one token per step) shows exactly what
re-decoding the whole output at every step showed, stop strings and partial characters included, and the final text
is `decode(output_ids)`."""

from __future__ import annotations

import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lorafaas.function_runtime.sampling import TextStream
from lorafaas.testing.tiny_models import build_tiny_tokenizer

TEXTS = ["Hello, world! The quick brown fox.", "naïve café — 東京 🚀 emoji 👩‍💻 done", "a\nb\tc  d", "<|im_end|> tail"]


class _WholeDecodes:
    """The tokenizer seen without its Rust backend: TextStream re-decodes the whole output at every step."""

    def __init__(self, tokenizer) -> None:
        self.decode = tokenizer.decode


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def _stream(tokenizer, ids: list[int], stop: tuple[str, ...]) -> tuple[list[str], str, bool]:
    stream = TextStream(tokenizer, stop)
    shown = []
    for end in range(1, len(ids) + 1):
        shown.append(stream.push(ids[:end]))
        if stream.stopped:
            break
    return shown, "".join(shown) + stream.finish(ids), stream.stopped


def test_a_fast_tokenizer_decodes_incrementally(tokenizer) -> None:
    stream = TextStream(tokenizer, ())
    assert stream._decoder is not None, "the Rust backend is used"
    assert TextStream(_WholeDecodes(tokenizer), ())._decoder is None


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_is_the_whole_decode(tokenizer, text: str) -> None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    shown, final, _ = _stream(tokenizer, ids, ())
    assert final == tokenizer.decode(ids, skip_special_tokens=True)
    assert shown == _stream(_WholeDecodes(tokenizer), ids, ())[0]
    assert all("\ufffd" not in piece for piece in shown), "a partial character is held back"


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), length=st.integers(1, 40), stops=st.lists(st.text(min_size=1, max_size=4),
                                                                                  max_size=2))
# the output ends in bytes that never make a character, and the stop string is the replacement character: the
# whole decode saw it at a step where the character was still incomplete and stopped; the incremental one never did
@example(seed=0, length=11, stops=["\ufffd"])
def test_incremental_and_whole_decodes_show_the_same_pieces(tokenizer, seed: int, length: int, stops: list) -> None:
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(length)]
    stop = tuple(stops)
    assert _stream(tokenizer, ids, stop) == _stream(_WholeDecodes(tokenizer), ids, stop)


def test_a_stop_string_split_across_tokens_cuts_the_text_before_it(tokenizer) -> None:
    ids = tokenizer("one two three four", add_special_tokens=False)["input_ids"]
    shown, final, stopped = _stream(tokenizer, ids, ("thr",))
    assert stopped and "".join(shown) == "one two " and final == "one two "
