"""The C text logit (classifier/_ngram_score.c) against the Python dict and numpy walks, its table and its guards."""

from __future__ import annotations

import math
import os
import random
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.classifier import ngrams
from gateway.classifier.ngrams import NgramWeights
from gateway.classifier.scoring import Classifier
from gateway.classifier.vocabulary import SHORT_TEXT_CHARS, CharNgrams, open_addressing
from tests.classifier.test_vocabulary import sharing_a_home

needs_native = pytest.mark.skipif(ngrams.native is None, reason="the optional C extension did not build")

# 1-byte (ASCII, Latin-1), 2-byte (CJK, a lone surrogate) and 4-byte (emoji) characters, whitespace runs
ALPHABET = "abcdefghij klmnop  \n\t.,?!0123 éßäñ ∫²— 日本語テ 😀🚀 \ud800"
UNKNOWN = "#%&XYZ~Ωж中🙂\udfff"  # never in the hand-made vocabulary: ASCII and not


def random_text(rng: random.Random, alphabet: str, max_chars: int) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, max_chars)))


def repeating_text(rng: random.Random) -> str:
    """Texts whose n-grams repeat, so that the norm's counts are not all one."""
    unit = random_text(rng, ALPHABET, 6) or "ab"
    return unit * rng.randint(2, 40) + rng.choice(["", " ", unit[:2]])


def spliced_text(rng: random.Random, sources: list[str], max_chars: int) -> str:
    """Slices of the vocabulary's source texts with unknown characters between: many n-grams are known."""
    pieces, chars = [], rng.randint(0, max_chars)
    while sum(map(len, pieces)) < chars:
        source = rng.choice(sources)
        start = rng.randrange(len(source) + 1)
        pieces += [source[start : start + rng.randint(1, 40)], rng.choice(UNKNOWN)]
    return "".join(pieces)


# what the hand-made vocabularies are cut from
SOURCES = [random_text(random.Random(i), ALPHABET, 200) for i in range(80)] + [
    repeating_text(random.Random(i)) for i in range(3)
]


def edge_texts() -> list[str]:
    return ["", "a", "ab", "abc", "abcd", "日", "😀😀", "\ud800", "aaaa" * 3, "café naïve", "x" * 5000]


def corpus(seed: int, max_chars: int) -> Iterator[str]:
    rng = random.Random(seed)
    yield from edge_texts()
    for _ in range(60):
        yield spliced_text(rng, SOURCES, 200)
        yield random_text(rng, ALPHABET, 80)
        yield random_text(rng, ALPHABET + UNKNOWN, 300)
        yield random_text(rng, "".join(map(chr, range(32, 127))), 120)  # plain ASCII
        yield repeating_text(rng)
    for _ in range(10):
        yield spliced_text(rng, SOURCES, max_chars)  # long: the numpy walk's sizes, and beyond the stack's


def hand_made(sizes: tuple[int, int], max_chars: int = 5_000) -> NgramWeights:
    """A vocabulary cut from SOURCES, with Gaussian weights."""
    text = CharNgrams(*sizes, max_chars=max_chars, tail_chars=0)
    rng = random.Random(sizes[0] * 10 + sizes[1])
    grams = {g for source in SOURCES for g in text.ngrams(text.preprocess(source))}
    return NgramWeights(text, {g: rng.gauss(0.0, 1.0) for g in sorted(grams)})


@pytest.fixture(scope="module")
def default_block() -> NgramWeights:
    return Classifier.default().text_block


@pytest.fixture(scope="module")
def block_2_4() -> NgramWeights:
    return hand_made((2, 4))


def assert_walks_agree(block: NgramWeights, raw_texts: list[str]) -> None:
    """The C logit equals its Python twin, the dict walk, on every text, and the texts are not trivial."""
    assert block._table is not None
    logits, repeats = [], 0
    for raw in raw_texts:
        text = block.text.preprocess(raw)
        logit = block._table.logit(text)
        assert logit == pytest.approx(block.dict_logit(text), abs=1e-12), raw
        logits.append(logit)
        repeats += len(set(block.text.ngrams(text))) < len(block.text.ngrams(text))
    assert np.count_nonzero(logits) > len(logits) // 3 and np.std(logits) > 0.05
    assert repeats > len(raw_texts) // 5  # the norm's squares are exercised, not just distinct counts
    assert any(len(block.text.preprocess(t)) > SHORT_TEXT_CHARS for t in raw_texts)


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="outside CI, a missing extension means the fallback")
def test_extension_builds_in_ci() -> None:
    assert ngrams.native is not None, "the C extension did not build: the classifier would score in Python"


@needs_native
def test_c_logit_equals_the_dict_walk_on_the_packaged_model(default_block: NgramWeights) -> None:
    rng = random.Random(3)
    prompts = ["Explain how a hash map handles collisions, with an example in Python.", "What's 2+2?"]
    prompts += [" ".join(rng.choices(prompts[0].split(), k=rng.randint(1, 200))) for _ in range(100)]
    assert_walks_agree(default_block, prompts + list(corpus(seed=1, max_chars=1_500)))


@needs_native
@pytest.mark.parametrize("sizes", [(2, 4), (4, 4), (1, 1), (1, 4), (3, 3)])
def test_c_logit_equals_the_dict_walk_on_a_hand_made_vocabulary(sizes: tuple[int, int]) -> None:
    assert_walks_agree(hand_made(sizes), list(corpus(seed=sum(sizes), max_chars=5_000)))


@needs_native
@settings(max_examples=300, deadline=None)
@given(st.text(st.sampled_from(ALPHABET + UNKNOWN) | st.characters(), max_size=400))
def test_c_logit_equals_the_dict_walk_on_any_text(block_2_4: NgramWeights, raw: str) -> None:
    text = block_2_4.text.preprocess(raw)
    assert block_2_4._table is not None
    assert block_2_4._table.logit(text) == pytest.approx(block_2_4.dict_logit(text), abs=1e-12)


def test_forced_fallback_scores_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the extension, NgramWeights takes the Python paths, and the figures do not change."""
    with_c = hand_made((2, 4))
    assert (with_c._table is None) == (ngrams.native is None)
    monkeypatch.setattr(ngrams, "native", None)
    without_c = hand_made((2, 4))
    assert without_c._table is None
    for raw in corpus(seed=5, max_chars=2_000):
        assert without_c.logit(raw) == pytest.approx(with_c.logit(raw), abs=1e-12)


def test_repeats_add_up_and_unknown_ngrams_count_for_nothing() -> None:
    block = NgramWeights(CharNgrams(4, 4), {"abab": 1.0, "baba": 0.5, "zzzz": 9.0})
    # abab twice, baba once: (2 * 1.0 + 0.5) / sqrt(2**2 + 1**2); "bab!", "ab!?" are not in the vocabulary
    assert block.logit("ababab!?") == pytest.approx(2.5 / math.sqrt(5), abs=1e-15)
    assert block.logit("ABAB") == pytest.approx(1.0, abs=1e-15)
    assert block.logit("nothing known here") == block.logit("") == block.logit("aba") == 0.0


@needs_native
@pytest.mark.parametrize("home", [5, 31])
def test_c_lookup_walks_past_colliding_keys(home: int) -> None:
    """1-grams whose keys are their ids: a text of those characters looks up each one past its collisions."""
    keys = sharing_a_home(16, 5, home)
    weights = np.linspace(-1.0, 1.0, len(keys)).tolist()
    alphabet = np.arange(0x4E00, 0x4E00 + max(keys), dtype=np.uint32)  # id i is chr(0x4E00 + i - 1)
    table = ngrams.native.Table(
        np.full(128, len(alphabet) + 1, np.uint16), alphabet, *open_addressing(keys, weights), 1, 1
    )
    chars = [chr(0x4E00 + k - 1) for k in keys]
    text = "".join(chars * 2) + chars[3] + "abc" + chr(0x4E00 + max(keys) + 5)
    counts = Counter(text)
    expected = sum(weights[i] * counts[c] for i, c in enumerate(chars)) / math.sqrt(sum(counts[c] ** 2 for c in chars))
    assert table.logit(text) == pytest.approx(expected, abs=1e-12)


def valid_arrays() -> dict[str, object]:
    keys, weights = open_addressing([1, 2 | 3 << 16], [0.5, -0.25])
    ascii_ids = np.full(128, 4, np.uint16)  # ASCII characters take this table, not the alphabet's search
    ascii_ids[[97, 98, 99]] = [1, 2, 3]
    return {
        "ascii_ids": ascii_ids,
        "alphabet": np.array([97, 98, 99], np.uint32),
        "keys": keys,
        "weights": weights,
    }


BAD_ARRAYS = [
    ("ascii_ids", np.full(127, 4, np.uint16), ValueError),
    ("ascii_ids", np.full(128, 4, np.uint32), TypeError),
    ("ascii_ids", np.full(128, 4, np.int16), TypeError),
    ("ascii_ids", [4] * 128, TypeError),
    ("alphabet", np.array([98, 97, 99], np.uint32), ValueError),
    ("alphabet", np.array([97, 97], np.uint32), ValueError),
    ("alphabet", np.arange(1, 65_536, dtype=np.uint32), ValueError),
    ("alphabet", np.array([97, 98], np.int32), TypeError),
    ("alphabet", np.array([97, 98], ">u4"), TypeError),
    ("keys", np.zeros(8, np.float64), TypeError),
    ("keys", np.zeros(7, np.uint64), ValueError),
    ("keys", np.zeros(12, np.uint64), ValueError),
    ("keys", np.arange(1, 9, dtype=np.uint64), ValueError),  # full: a missed lookup would never end
    ("keys", np.zeros((2, 4), np.uint64), TypeError),
    ("keys", np.zeros(16, np.uint64)[::2], (ValueError, BufferError, TypeError)),  # not contiguous
    ("weights", np.zeros(8, np.float32), TypeError),
    ("weights", np.zeros(16, np.float64), ValueError),
]


@needs_native
@pytest.mark.parametrize(("name", "value", "error"), BAD_ARRAYS)
def test_bad_arrays_raise(name: str, value: object, error: type[Exception]) -> None:
    arrays: dict[str, object] = {**valid_arrays(), name: value}
    with pytest.raises(error):
        ngrams.native.Table(*arrays.values(), 1, 2)


@needs_native
@pytest.mark.parametrize("sizes", [(0, 2), (3, 2), (1, 5)])
def test_bad_ngram_sizes_raise(sizes: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="n-gram sizes"):
        ngrams.native.Table(*valid_arrays().values(), *sizes)


@needs_native
def test_valid_arrays_score_and_bad_texts_raise() -> None:
    table = ngrams.native.Table(*valid_arrays().values(), 1, 2)
    # ids: a=1, b=2, c=3; key 1 is "a", key 2 | 3 << 16 is "bc"
    assert table.logit("abc") == pytest.approx((0.5 - 0.25) / math.sqrt(2))
    assert table.logit("") == table.logit("zz") == 0.0
    for text in (b"abc", None, 3):
        with pytest.raises(TypeError, match="str"):
            table.logit(text)
