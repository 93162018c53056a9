"""classifier/vocabulary.py: the training analyzer's n-grams of a text, and the vocabulary's characters as the
16-bit ids its integer keys are made of."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from gateway.classifier.vocabulary import Alphabet, CharNgrams, home_slot, open_addressing, table_capacity


def test_long_text_keeps_head_and_tail() -> None:
    ngrams = CharNgrams(3, 4, max_chars=100, tail_chars=30)
    clipped = ngrams.clip("h" * 200 + "QUESTION" + "t" * 22)
    assert len(clipped) == 100 and clipped.startswith("h" * 70) and clipped.endswith("QUESTION" + "t" * 22)


def test_ngrams_are_cut_after_lowering_and_collapsing_whitespace_runs() -> None:
    text = CharNgrams(2, 3)
    cut = text.preprocess("AB  c\nD")
    assert cut == "ab c\nd"  # a run of whitespace becomes one space; a single newline stays
    assert text.ngrams(cut) == ("ab", "b ", " c", "c\n", "\nd", "ab ", "b c", " c\n", "c\nd")  # by size, then position


def test_bad_ngram_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="n-gram sizes"):
        CharNgrams(3, 5)
    with pytest.raises(ValueError, match="tail_chars"):
        CharNgrams(4, 4, max_chars=10, tail_chars=11)


def test_the_alphabet_numbers_its_characters_from_one_in_code_point_order() -> None:
    alphabet = Alphabet({"ba": 1.0, "é!": 0.5})
    assert alphabet.chars == ["!", "a", "b", "é"] and alphabet.unknown == 5
    assert alphabet.key("ba") == 3 | 2 << 16  # the first character in the low 16 bits
    assert alphabet.key("b") != alphabet.key("ba") and alphabet.key("b") == alphabet.key("ba") & 0xFFFF
    ids = alphabet.ascii_ids()
    assert (ids[ord("!")], ids[ord("a")], ids[ord("b")], ids[ord("z")]) == (1, 2, 3, 5)  # z: unknown


def test_an_alphabet_past_16_bit_ids_is_refused() -> None:
    with pytest.raises(ValueError, match="65535 distinct characters"):
        Alphabet({chr(0x20000 + i): 0.0 for i in range(65_535)})


def test_the_table_is_a_power_of_two_at_most_half_full() -> None:
    for keys in (0, 1, 4, 5, 1_000, 92_914):
        capacity = table_capacity(keys)
        assert capacity & (capacity - 1) == 0 and capacity >= max(8, 2 * keys)
    assert home_slot(0, 3) == 0 and all(0 <= home_slot(k * 7919, 10) < 1024 for k in range(1, 5_000))


def probe(table_keys: Sequence[int], key: int) -> int | None:
    """Where a linear-probing lookup from the key's home slot finds it, as the C lookup walks."""
    slot = home_slot(key, len(table_keys).bit_length() - 1)
    while table_keys[slot] != 0:
        if table_keys[slot] == key:
            return slot
        slot = (slot + 1) % len(table_keys)
    return None


def sharing_a_home(count: int, bits: int, home: int) -> list[int]:
    """count distinct keys below 2**16 whose home slot in a table of 2**bits slots is home."""
    return [key for key in range(1, 1 << 16) if home_slot(key, bits) == home][:count]


@pytest.mark.parametrize("home", [0, 13, 31])  # 31, the last slot: the probes wrap around
def test_table_holds_keys_that_share_a_home_slot(home: int) -> None:
    rng = random.Random(home)
    keys = sharing_a_home(12, 5, home) + sharing_a_home(4, 5, (home + 3) % 32)
    weights = [rng.gauss(0.0, 1.0) for _ in keys]
    table_keys, table_weights = open_addressing(keys, weights)
    assert len(table_keys) == 32  # 16 keys, half full
    for key, weight in zip(keys, weights, strict=True):
        slot = probe(table_keys, key)
        assert slot is not None and table_weights[slot] == weight
    assert probe(table_keys, sharing_a_home(13, 5, home)[-1]) is None


def test_table_of_many_random_keys_finds_each_and_only_them() -> None:
    rng = random.Random(0)
    keys = sorted({rng.randrange(1, 2**63) for _ in range(5_000)})
    table_keys, table_weights = open_addressing(keys, [float(k) for k in keys])
    assert len(table_keys) == 16_384 and sum(1 for k in table_keys if k) == len(keys)
    assert all(table_weights[probe(table_keys, k) or 0] == float(k) for k in keys)
    assert probe(table_keys, 12345) is None
    assert len(open_addressing([], [])[0]) == 8  # an empty vocabulary still has slots
