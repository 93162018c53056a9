"""classifier/packed.py: the vocabulary as sorted keys scored with numpy (the fallback without the C extension and
the reference the C table is tested against), and its open-addressing table builder."""

from __future__ import annotations

import random

import numpy as np
import pytest

from gateway.classifier.ngrams import NgramWeights
from gateway.classifier.packed import PackedVocabulary, home_slots, open_addressing
from gateway.classifier.vocabulary import CharNgrams, home_slot


def random_text(rng: random.Random) -> str:
    alphabet = "abcdefghij klmnopqrstuvwxyz  \n\tÄéß∫²😀日本0123456789.,?!"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 300)))


def probe(table_keys: np.ndarray, key: int) -> int | None:
    """Where a linear-probing lookup from the key's home slot finds it, as the C lookup walks."""
    slot = int(home_slots(np.array([key], dtype=np.uint64), len(table_keys).bit_length() - 1)[0])
    while table_keys[slot] != 0:
        if table_keys[slot] == key:
            return slot
        slot = (slot + 1) % len(table_keys)
    return None


def sharing_a_home(count: int, bits: int, home: int) -> np.ndarray:
    """count distinct keys below 2**16 whose home slot in a table of 2**bits slots is home."""
    candidates = np.arange(1, 1 << 16, dtype=np.uint64)
    return candidates[home_slots(candidates, bits) == home][:count]


@pytest.mark.parametrize("home", [0, 13, 31])  # 31, the last slot: the probes wrap around
def test_table_holds_keys_that_share_a_home_slot(home: int) -> None:
    rng = np.random.default_rng(home)
    keys = np.concatenate([sharing_a_home(12, 5, home), sharing_a_home(4, 5, (home + 3) % 32)])
    weights = rng.normal(size=len(keys))
    table_keys, table_weights = open_addressing(keys, weights)
    assert len(table_keys) == 32  # 16 keys, half full
    for key, weight in zip(keys, weights, strict=True):
        slot = probe(table_keys, int(key))
        assert slot is not None and table_weights[slot] == weight
    assert probe(table_keys, int(sharing_a_home(13, 5, home)[-1])) is None


def test_table_of_many_random_keys_finds_each_and_only_them() -> None:
    rng = np.random.default_rng(0)
    keys = np.unique(rng.integers(1, 2**63, size=5_000, dtype=np.uint64))
    table_keys, table_weights = open_addressing(keys, keys.astype(np.float64))
    assert len(table_keys) == 16_384 and np.count_nonzero(table_keys) == len(keys)
    assert all(table_weights[probe(table_keys, int(k))] == float(k) for k in keys)
    assert probe(table_keys, 12345) is None
    assert len(open_addressing(keys[:0], table_weights[:0])[0]) == 8  # an empty vocabulary still has slots


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


def test_numpy_home_slots_are_the_plain_python_ones() -> None:
    """The C table's builder (plain Python) and this reference (numpy) must agree on every key's home slot."""
    keys = np.random.default_rng(4).integers(1, 2**63, size=2_000, dtype=np.uint64)
    for bits in (3, 13, 20):
        assert home_slots(keys, bits).tolist() == [home_slot(int(k), bits) for k in keys]
