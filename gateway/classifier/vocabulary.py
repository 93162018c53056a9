"""A text's character n-grams as the classifier's training analyzer cuts them, and the vocabulary's characters as
the 16-bit ids its integer keys are made of (shared by the C table's builder and the numpy walk)."""

from __future__ import annotations

import functools
import operator
import re
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

# sklearn's char analyzer collapses runs of whitespace (not single newlines) to one space.
_WHITE_SPACES = re.compile(r"\s\s+")
MAX_NGRAM = 4  # four 16-bit character ids pack into one uint64 key
# Up to about this many characters the dict walk beats numpy's fixed per-call cost (measured on MMLU
# text, 4-grams: docs/performance.md, 'Why the code is shaped so'); its memoized n-gram getters for
# these lengths hold a small, bounded set of slices.
SHORT_TEXT_CHARS = 256

# 2**64 / golden ratio: the top bits of key * this spread keys that differ in any character id
HASH_MULTIPLIER = 0x9E3779B97F4A7C15
MASK_64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class CharNgrams:
    """scikit-learn's analyzer="char" n-grams of a text's head and tail: what the text block counts."""

    ngram_min: int = 4
    ngram_max: int = 4
    lowercase: bool = True
    max_chars: int = 1_000  # the walk's cost grows with the text: this bounds the score's cost
    tail_chars: int = 300

    def __post_init__(self) -> None:
        if not 1 <= self.ngram_min <= self.ngram_max <= MAX_NGRAM:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max <= {MAX_NGRAM}, got {self.sizes}")
        if not 0 <= self.tail_chars <= self.max_chars:
            raise ValueError(f"tail_chars must be within [0, max_chars], got {self.tail_chars}")

    @property
    def sizes(self) -> range:
        return range(self.ngram_min, self.ngram_max + 1)

    def clip(self, text: str) -> str:
        """At most max_chars: the head and the last tail_chars, where a long prompt's ask usually is."""
        if len(text) <= self.max_chars:
            return text
        return text[: self.max_chars - self.tail_chars] + text[len(text) - self.tail_chars :]

    def preprocess(self, text: str) -> str:
        """The text the n-grams are cut from, exactly as the training analyzer sees it."""
        text = self.clip(text)
        return _WHITE_SPACES.sub(" ", text.lower() if self.lowercase else text)

    def ngrams(self, text: str) -> tuple[str, ...]:
        """The n-grams of a preprocessed text, in scikit-learn's order."""
        if len(text) <= SHORT_TEXT_CHARS:
            return _cutter(self.ngram_min, self.ngram_max, len(text))(text)
        return tuple(map(text.__getitem__, _slices(self.ngram_min, self.ngram_max, len(text))))


def _slices(ngram_min: int, ngram_max: int, n_chars: int) -> list[slice]:
    return [slice(i, i + n) for n in range(ngram_min, ngram_max + 1) for i in range(n_chars - n + 1)]


@functools.lru_cache(maxsize=2 * SHORT_TEXT_CHARS)
def _cutter(ngram_min: int, ngram_max: int, n_chars: int) -> Callable[[str], tuple[str, ...]]:
    """All n-grams of a text of n_chars characters in one C call: itemgetter(*slices) is about twice as
    cheap as a map over the slices, and memoized for the lengths of short texts."""
    slices = _slices(ngram_min, ngram_max, n_chars)
    if len(slices) > 1:
        return operator.itemgetter(*slices)
    return lambda text: tuple(text[s] for s in slices)  # itemgetter of one item returns it bare


class Alphabet:
    """The vocabulary's characters as 16-bit ids from 1, sorted by code point; len + 1 is the unknown id."""

    def __init__(self, weights: Mapping[str, float]) -> None:
        self.chars = sorted({c for gram in weights for c in gram})
        if len(self.chars) + 2 > 1 << 16:  # the unknown id and the all-ones sentinel key must stay free
            raise ValueError(f"{len(self.chars)} distinct characters do not fit 16-bit ids")
        self.unknown = len(self.chars) + 1
        self.id_of = {c: i for i, c in enumerate(self.chars, start=1)}

    def key(self, gram: str) -> int:
        """An n-gram's characters as 16-bit ids, the first in the low bits: a shorter n-gram's key has zero
        high slots that no longer one has, so a key match is an exact n-gram match."""
        return sum(self.id_of[c] << (16 * k) for k, c in enumerate(gram))

    def ascii_ids(self) -> array[int]:
        ids = array("H", [self.unknown] * 128)  # most prompts are ASCII: the C walk maps them by index
        for c, i in self.id_of.items():
            if ord(c) < 128:
                ids[ord(c)] = i
        return ids


def home_slot(key: int, bits: int) -> int:
    """Where a key's lookup starts in a table of 2**bits slots, exactly as gateway/native/_ngram_score.c."""
    return ((key * HASH_MULTIPLIER) & MASK_64) >> (64 - bits)


def table_capacity(keys: int) -> int:
    """Slots for this many keys: a power of two at least twice as many (the C table's load factor <= 0.5)."""
    return 1 << max(3, (2 * keys - 1).bit_length())


def open_addressing(keys: Sequence[int], weights: Sequence[float]) -> tuple[array[int], array[float]]:
    """Distinct nonzero keys and their weights as the C table's slots: linear probing, at most half full (key 0
    marks an empty slot), each key at its home slot or the first free one after it, where a lookup finds it."""
    capacity = table_capacity(len(keys))
    bits, mask = capacity.bit_length() - 1, capacity - 1
    table_keys, table_weights = array("Q", bytes(8 * capacity)), array("d", bytes(8 * capacity))
    for key, weight in zip(keys, weights, strict=True):
        slot = home_slot(key, bits)
        while table_keys[slot] not in (0, key):
            slot = (slot + 1) & mask
        table_keys[slot], table_weights[slot] = key, weight
    return table_keys, table_weights
