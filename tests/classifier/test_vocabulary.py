"""classifier/vocabulary.py: the training analyzer's n-grams of a text, and the vocabulary's characters as the
16-bit ids its integer keys are made of."""

from __future__ import annotations

import pytest

from gateway.classifier.vocabulary import Alphabet, CharNgrams, home_slot, table_capacity


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
