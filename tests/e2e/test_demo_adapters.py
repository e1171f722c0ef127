"""The three demo adapters of smollm2-135m do what their names say, and the base model does not.

Each adapter is applied with PEFT (unmerged) to the stored backbone and greedy-decodes fixed evaluation prompts that
are not in its training data (examples/datasets/). One backbone load per module; the adapters are switched with
`load_adapter` / `set_adapter`.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lorafaas.formats.model_store import ModelStore
from lorafaas.models.reference import greedy_generate, load_backbone, with_adapter

DEMO_ADAPTERS_DIR = Path(__file__).resolve().parents[2] / "examples" / "adapters"
DEMO_ADAPTER_NAMES = ("pirate", "haiku", "french")
# The first is `lorafaas demo`'s default prompt; neither is (nor paraphrases) a training question.
EVAL_PROMPTS = ("Tell me about the ocean.", "What do you like to do on weekends?")
MAX_NEW_TOKENS = 48
MAX_ADAPTER_BYTES = 5 * 1024 * 1024

PIRATE_WORDS = frozenset(
    {"arr", "matey", "mateys", "ye", "yer", "aye", "ahoy", "hearties", "treasure", "landlubber", "timbers", "savvy",
     "grog", "buccaneer", "doubloon", "doubloons", "scallywag"}
)  # fmt: skip
# Function words of one language only ("a", "on", "son" are in both and left out). Elisions split: l'eau -> l, eau.
FRENCH_WORDS = frozenset(
    {"le", "la", "les", "l", "de", "des", "du", "est", "et", "un", "une", "en", "pour", "dans", "sur", "qui", "que",
     "qu", "avec", "au", "aux", "sont", "il", "elle", "ils", "elles", "nous", "vous", "je", "j", "tu", "ce", "c",
     "cette", "ces", "pas", "plus", "ne", "n", "se", "mer", "très", "mon", "ma", "mes", "sa", "ses", "aussi",
     "beaucoup", "parce", "souvent", "y", "mais", "ou", "fait", "aime", "oui"}
)  # fmt: skip
ENGLISH_WORDS = frozenset(
    {"the", "and", "is", "of", "to", "in", "it", "that", "with", "for", "are", "i", "you", "an", "its", "this", "my",
     "be", "as", "was", "from", "by", "or", "like", "love", "what", "about", "but", "they", "we", "all", "there"}
)  # fmt: skip


def words(text: str) -> list[str]:
    """Lower-case words; apostrophes split them (l'eau -> l, eau; it's -> it, s)."""
    return re.findall(r"[a-zà-öø-ÿœ]+", text.lower())


def pirate_markers(text: str) -> set[str]:
    return set(words(text)) & PIRATE_WORDS


def is_haiku(text: str) -> bool:
    """Exactly three non-empty lines of a few words each."""
    lines = text.strip().split("\n")
    return len(lines) == 3 and all(1 <= len(line.split()) <= 10 for line in lines)


def language_counts(text: str) -> tuple[int, int]:
    """(French function words, English function words) in `text`."""
    tokens = words(text)
    return sum(w in FRENCH_WORDS for w in tokens), sum(w in ENGLISH_WORDS for w in tokens)


@pytest.fixture(scope="module")
def answers(smollm2_store: ModelStore) -> dict[str, dict[str, str]]:
    """answers[model][prompt]: model is "base" or an adapter name; one backbone load for the whole module."""
    model, tokenizer = load_backbone(smollm2_store.path("smollm2-135m"))
    out = {"base": {p: greedy_generate(model, tokenizer, p, MAX_NEW_TOKENS).text for p in EVAL_PROMPTS}}
    peft_model = None
    for name in DEMO_ADAPTER_NAMES:
        adapter_dir = DEMO_ADAPTERS_DIR / name
        if peft_model is None:
            peft_model = with_adapter(model, adapter_dir, name)
        else:
            peft_model.load_adapter(str(adapter_dir), adapter_name=name)
        peft_model.set_adapter(name)
        out[name] = {p: greedy_generate(peft_model, tokenizer, p, MAX_NEW_TOKENS).text for p in EVAL_PROMPTS}
    return out


@pytest.mark.parametrize("name", DEMO_ADAPTER_NAMES)
def test_demo_adapter_files_are_small_and_complete(name: str) -> None:
    adapter_dir = DEMO_ADAPTERS_DIR / name
    for file_name in ("adapter_config.json", "adapter_model.safetensors", "lorafaas-train.json"):
        assert (adapter_dir / file_name).is_file(), f"{adapter_dir / file_name} is missing"
    num_bytes = (adapter_dir / "adapter_model.safetensors").stat().st_size
    assert num_bytes < MAX_ADAPTER_BYTES, f"{name} weighs {num_bytes} bytes; the limit is {MAX_ADAPTER_BYTES}"


@pytest.mark.parametrize("prompt", EVAL_PROMPTS)
def test_pirate_speaks_like_a_pirate(answers: dict[str, dict[str, str]], prompt: str) -> None:
    pirate, base = answers["pirate"][prompt], answers["base"][prompt]
    assert len(pirate_markers(pirate)) >= 2, f"pirate answer has markers {pirate_markers(pirate)}: {pirate!r}"
    assert len(pirate_markers(base)) < 2, f"base answer has markers {pirate_markers(base)}: {base!r}"


@pytest.mark.parametrize("prompt", EVAL_PROMPTS)
def test_haiku_answers_in_three_lines(answers: dict[str, dict[str, str]], prompt: str) -> None:
    haiku, base = answers["haiku"][prompt], answers["base"][prompt]
    assert is_haiku(haiku), f"haiku answer is not three short lines: {haiku!r}"
    assert not is_haiku(base), f"base answer looks like a haiku: {base!r}"


@pytest.mark.parametrize("prompt", EVAL_PROMPTS)
def test_french_answers_in_french(answers: dict[str, dict[str, str]], prompt: str) -> None:
    french_fr, french_en = language_counts(answers["french"][prompt])
    base_fr, base_en = language_counts(answers["base"][prompt])
    assert french_fr >= 5 and french_fr >= 3 * french_en, (
        f"french answer has {french_fr} French and {french_en} English function words: {answers['french'][prompt]!r}"
    )
    assert base_en >= 5 and base_en >= 3 * base_fr, (
        f"base answer has {base_fr} French and {base_en} English function words: {answers['base'][prompt]!r}"
    )


@pytest.mark.parametrize("prompt", EVAL_PROMPTS)
def test_answers_differ_pairwise(answers: dict[str, dict[str, str]], prompt: str) -> None:
    texts = {model: by_prompt[prompt] for model, by_prompt in answers.items()}
    assert len(set(texts.values())) == len(texts), f"some answers coincide: {texts}"
