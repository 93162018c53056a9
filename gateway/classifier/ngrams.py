"""Character n-grams of a text and the classifier's weight for each: the text block of its logit.

The optional C extension gateway.classifier._ngram_score scores every text when it built: inside the running gateway
the dict walk cost 35-60 µs per short prompt (each lookup missing cache and TLB in ~10 MB of Python
objects); the Python paths here are the fallback, and the reference the extension is tested against.
"""

from __future__ import annotations

import functools
import math
import operator
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

try:
    from gateway.classifier import _ngram_score as native
except ImportError:  # the optional extension did not compile: the Python paths score alone
    native = None  # type: ignore[assignment]

# sklearn's char analyzer collapses runs of whitespace (not single newlines) to one space.
_WHITE_SPACES = re.compile(r"\s\s+")
MAX_NGRAM = 4  # four 16-bit character ids pack into one uint64 key
# Up to about this many characters the dict walk beats numpy's fixed per-call cost (measured here on
# MMLU text, 4-grams: 8 vs 11 µs at 150 characters, 10 vs 12 at 250, 26 vs 13 at 600); its memoized
# n-gram getters for these lengths hold about 2 MB of slices.
SHORT_TEXT_CHARS = 256

IdArray = npt.NDArray[np.uint64]
FloatArray = npt.NDArray[np.float64]


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


class NgramWeights:
    """A weight per vocabulary n-gram; the text's part of the logit is w . x / ||x||, x its n-gram counts.

    N-grams outside the vocabulary count for nothing, neither in the dot product nor in the norm: they are
    what scikit-learn's CountVectorizer(vocabulary=...) drops. The vocabulary is held as an open-addressing
    table for the C extension, which scores every text when it built; and for the Python paths, as a dict
    for the short texts most requests carry and as sorted integer keys for numpy on long ones.
    """

    def __init__(self, text: CharNgrams, weights: Mapping[str, float]) -> None:
        self.text = text
        self.weights = dict(weights)  # insertion order is the training matrix's column order
        self._packed = PackedVocabulary.build(text, self.weights)
        self._table = self._packed.native_table() if self._packed is not None else None

    def logit(self, text: str) -> float:
        """The text block's contribution to the logit."""
        text = self.text.preprocess(text)
        if self._table is not None:
            return self._table.logit(text)
        if len(text) <= SHORT_TEXT_CHARS or self._packed is None:
            return self._short_logit(text)
        return self._packed.logit(text)

    @functools.cached_property
    def _walk_index(self) -> tuple[dict[str, int], list[float]]:
        """The dict walk's vocabulary: each n-gram's position from 1 (so filter(None, ...) drops the misses
        and nothing else) and the weights by position (a list index is much cheaper than a numpy read).
        Built on first use: with the C table, about 8 MB of Python objects a process need not hold."""
        return {gram: i for i, gram in enumerate(self.weights, start=1)}, [0.0, *self.weights.values()]

    def _short_logit(self, text: str) -> float:
        """map/filter/sum keep the per-n-gram work in C; a text that repeats no n-gram skips the Counter."""
        position, values = self._walk_index
        positions = list(filter(None, map(position.get, self.text.ngrams(text))))
        if not positions:
            return 0.0
        dot = sum(map(values.__getitem__, positions))
        if len(set(positions)) == len(positions):
            return dot / math.sqrt(len(positions))
        counts = Counter(positions).values()  # repeats add up before squaring
        return dot / math.sqrt(sum(map(operator.mul, counts, counts)))

    def contributions(self, text: str) -> dict[str, float]:
        """Each vocabulary n-gram of the text and its share of the text's logit (for explanations)."""
        counts = Counter(g for g in self.text.ngrams(self.text.preprocess(text)) if g in self.weights)
        norm = math.sqrt(sum(c * c for c in counts.values())) or 1.0
        return {gram: count * self.weights[gram] / norm for gram, count in counts.items()}


class PackedVocabulary:
    """The vocabulary as sorted uint64 keys: an n-gram's characters as 16-bit ids, the first in the low bits.

    Ids start at 1, so a shorter n-gram's key has zero high slots that no longer one has; characters
    outside the vocabulary's alphabet get an id no key contains, so a key match is an exact n-gram match.
    With a text's ids laid out as uint16, the keys of all its n-grams are one unaligned uint64 view.
    """

    def __init__(self, text: CharNgrams, weights: Mapping[str, float]) -> None:
        chars = sorted({c for gram in weights for c in gram})
        if len(chars) + 2 > 1 << 16:  # the unknown id and the all-ones sentinel key must stay free
            raise ValueError(f"{len(chars)} distinct characters do not fit 16-bit ids")
        self.text = text
        self.unknown = len(chars) + 1
        # a sentinel above any code point and a key never built: searchsorted never runs off the end
        self.alphabet = np.array([*map(ord, chars), 0xFFFFFFFF], dtype=np.uint32)
        self.ascii_ids = np.full(128, self.unknown, dtype="<u2")  # most long prompts are ASCII: one gather
        id_of = {c: i for i, c in enumerate(chars, start=1)}
        for c, i in id_of.items():
            if ord(c) < 128:
                self.ascii_ids[ord(c)] = i
        keys = np.array([sum(id_of[c] << (16 * k) for k, c in enumerate(gram)) for gram in weights], np.uint64)
        order = np.argsort(keys)
        self.keys = np.append(keys[order], np.uint64(2**64 - 1))
        values = np.fromiter(weights.values(), dtype=np.float64, count=len(keys))
        self.key_weights = np.append(values[order], 0.0)

    @classmethod
    def build(cls, text: CharNgrams, weights: Mapping[str, float]) -> PackedVocabulary | None:
        """The packed form, or None when the alphabet is too large for 16-bit ids; long texts then take
        the dict walk too (slower, same result)."""
        try:
            return cls(text, weights)
        except ValueError:
            return None

    def native_table(self) -> native.Table | None:
        """The C extension's open-addressing table of this vocabulary, or None when it did not build."""
        if native is None:
            return None
        keys, weights = open_addressing(self.keys[:-1], self.key_weights[:-1])  # without the sentinel
        sizes = self.text.ngram_min, self.text.ngram_max
        return native.Table(self.ascii_ids, self.alphabet[:-1], keys, weights, *sizes)

    def ids(self, text: str) -> npt.NDArray[np.uint16]:
        """Each character's id, then MAX_NGRAM - 1 zeros so that every n-gram's view stays in bounds."""
        ids = np.zeros(len(text) + MAX_NGRAM - 1, dtype="<u2")
        if text.isascii():
            np.take(self.ascii_ids, np.frombuffer(text.encode("ascii"), dtype=np.uint8), out=ids[: len(text)])
            return ids
        codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        position = np.searchsorted(self.alphabet, codes)
        ids[: len(text)] = np.where(self.alphabet[position] == codes, position + 1, self.unknown)
        return ids

    def text_keys(self, text: str) -> IdArray:
        """The key of every n-gram of a preprocessed text, all sizes, in scikit-learn's order."""
        ids = self.ids(text)
        # starts[i] reads the ids of characters i .. i+3 as one little-endian uint64: the 4-gram's key
        starts = np.ndarray((len(text),), dtype="<u8", buffer=ids, strides=(2,))
        runs = []
        for n in self.text.sizes:
            keys = starts[: max(len(text) - n + 1, 0)]
            runs.append(keys if n == MAX_NGRAM else keys & np.uint64((1 << (16 * n)) - 1))
        return np.concatenate(runs) if len(runs) > 1 else runs[0]

    def logit(self, text: str) -> float:
        """w . x / ||x|| over the text's vocabulary n-grams, vectorized.

        Sorting the keys first groups repeats, so each distinct n-gram is looked up once, and its count
        comes from the run length instead of a second sort.
        """
        keys = np.sort(self.text_keys(text))
        if not len(keys):
            return 0.0
        starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))
        distinct = keys[starts]
        position = np.searchsorted(self.keys, distinct)
        known = self.keys[position] == distinct
        counts = np.diff(np.append(starts, len(keys)))[known]
        if not len(counts):
            return 0.0
        return float(counts.dot(self.key_weights[position[known]])) / math.sqrt(float(counts.dot(counts)))


# 2**64 / golden ratio: the top bits of key * this spread keys that differ in any character id
HASH_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)


def home_slots(keys: IdArray, bits: int) -> IdArray:
    """Where each key's lookup starts in a table of 2**bits slots, exactly as gateway/classifier/_ngram_score.c."""
    return (keys * HASH_MULTIPLIER) >> np.uint64(64 - bits)


def open_addressing(keys: IdArray, weights: FloatArray) -> tuple[IdArray, FloatArray]:
    """Distinct nonzero keys and their weights as a linear-probing table at most half full (key 0: empty).

    Placed in rounds: in round r each key still waiting tries its home slot + r, and each free slot takes
    one of the keys that tried it. A key thus moves past taken slots only, as a lookup from its home expects.
    """
    capacity = 1 << max(3, (2 * len(keys) - 1).bit_length())
    table_keys = np.zeros(capacity, dtype=np.uint64)
    table_weights = np.zeros(capacity, dtype=np.float64)
    home = home_slots(keys, capacity.bit_length() - 1)
    waiting, step = np.arange(len(keys)), 0
    while len(waiting):
        slots = (home[waiting] + np.uint64(step)) & np.uint64(capacity - 1)
        free = np.flatnonzero(table_keys[slots] == 0)
        taken, first = np.unique(slots[free], return_index=True)  # one key per contested slot
        placed = free[first]
        table_keys[taken] = keys[waiting[placed]]
        table_weights[taken] = weights[waiting[placed]]
        waiting = np.delete(waiting, placed)
        step += 1
    return table_keys, table_weights
