"""classifier/packed.py: the vocabulary as sorted keys scored with numpy (the fallback without the C extension and
a reference the C logit is tested against)."""

from __future__ import annotations

import random

import pytest

from gateway.classifier.ngrams import NgramWeights
from gateway.classifier.packed import PackedVocabulary
from gateway.classifier.vocabulary import CharNgrams


def random_text(rng: random.Random) -> str:
    alphabet = "abcdefghij klmnopqrstuvwxyz  \n\tÄéß∫²😀日本0123456789.,?!"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 300)))


@pytest.mark.parametrize("sizes", [(4, 4), (3, 4), (1, 2)])
def test_numpy_walk_equals_dict_walk(sizes: tuple[int, int]) -> None:
    """The packed-key lookup for long texts and the dict lookup for short ones give the same logit."""
    ngrams = CharNgrams(*sizes, max_chars=5_000, tail_chars=0)
    rng = random.Random(sum(sizes))
    corpus = [random_text(rng) for _ in range(200)]
    vocabulary = sorted({g for t in corpus[:100] for g in ngrams.ngrams(ngrams.preprocess(t))})
    block = NgramWeights(ngrams, {g: rng.gauss(0.0, 1.0) for g in vocabulary})
    assert block._packed is not None
    for raw in [*corpus[100:], "", "a", "\ud800 lone surrogate", "日本" * 300, " ".join(corpus)]:
        text = ngrams.preprocess(raw)
        assert block._packed.logit(text) == pytest.approx(block._short_logit(text), abs=1e-12)


def test_alphabet_too_large_for_packed_keys_falls_back_to_the_dict_walk() -> None:
    ngrams = CharNgrams(2, 2)  # 16-bit character ids: at most 65,534 distinct characters
    weights = {chr(0x20000 + i) * 2: 0.001 * (i % 100) for i in range(65_535)}
    assert PackedVocabulary.build(ngrams, weights) is None
    block = NgramWeights(ngrams, weights)
    text = (chr(0x20000 + 7) * 2 + " ") * 200
    assert block.logit(text) == pytest.approx(0.007, rel=1e-9)
