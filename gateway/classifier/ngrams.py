"""Character n-grams of a text and the classifier's weight for each: the text block of its logit.

The C extension gateway.native._ngram_score scores every text where it built (the image builds it): inside the
running gateway the dict walk was slow even on a short prompt (each lookup missing cache and TLB across the weights'
many Python objects: docs/performance.md, 'Why the code is shaped so'). The dict walk here is its one Python twin: the
reference it is tested against, and the fallback.
"""

from __future__ import annotations

import functools
import math
import operator
from array import array
from collections import Counter
from collections.abc import Callable, Mapping

from gateway.classifier.vocabulary import Alphabet, CharNgrams, open_addressing
from gateway.native import ngram_score as native  # None: the dict walk scores every text


class NgramWeights:
    """A weight per vocabulary n-gram; the text's part of the logit is w . x / ||x||, x its n-gram counts.

    N-grams outside the vocabulary count for nothing, neither in the dot product nor in the norm: they are
    what scikit-learn's CountVectorizer(vocabulary=...) drops. The vocabulary is held as an open-addressing
    table for the C extension, which scores every text when it built; and for its Python twin, as a dict.
    """

    def __init__(self, text: CharNgrams, weights: Mapping[str, float],
                 read_back: Callable[[], Mapping[str, float]] | None = None) -> None:
        self.text = text
        kept = dict(weights)  # insertion order is the training matrix's column order
        self._table = native_table(text, kept) if native is not None else None
        # With the C table scoring and the artifact to read them back from, the weights are not kept: many
        # Python objects resident in a serving process that reads them only to explain a score or retrain.
        self._read_back = read_back if self._table is not None else None
        self._kept = kept if self._read_back is None else None

    @property
    def weights(self) -> dict[str, float]:
        """Each vocabulary n-gram's weight: kept, or read back from the artifact at each use (explanations)."""
        if self._kept is not None:
            return self._kept
        assert self._read_back is not None
        return dict(self._read_back())

    def logit(self, text: str) -> float:
        """The text block's contribution to the logit."""
        text = self.text.preprocess(text)
        if self._table is not None:
            return self._table.logit(text)
        return self.dict_logit(text)

    @functools.cached_property
    def _walk_index(self) -> tuple[dict[str, int], list[float]]:
        """The dict walk's vocabulary: each n-gram's position from 1 (so filter(None, ...) drops the misses
        and nothing else) and the weights by position (a list index is much cheaper than a numpy read).
        Built on first use: with the C table, Python objects a process need not hold."""
        return {gram: i for i, gram in enumerate(self.weights, start=1)}, [0.0, *self.weights.values()]

    def dict_logit(self, text: str) -> float:
        """The C table's Python twin, over a preprocessed text: map/filter/sum keep the per-n-gram work in the
        interpreter's C; a text that repeats no n-gram skips the Counter."""
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
        weights = self.weights
        counts = Counter(g for g in self.text.ngrams(self.text.preprocess(text)) if g in weights)
        norm = math.sqrt(sum(c * c for c in counts.values())) or 1.0
        return {gram: count * weights[gram] / norm for gram, count in counts.items()}


def native_table(text: CharNgrams, weights: Mapping[str, float]) -> native.Table | None:
    """The C extension's open-addressing table of this vocabulary (linear probing from each key's home slot),
    built in plain Python; None when the alphabet does not fit 16-bit ids (the dict walk then scores)."""
    try:
        alphabet = Alphabet(weights)
    except ValueError:
        return None
    keys, values = open_addressing([alphabet.key(gram) for gram in weights], list(weights.values()))
    code_points = array("I", map(ord, alphabet.chars))
    return native.Table(alphabet.ascii_ids(), code_points, keys, values, text.ngram_min, text.ngram_max)
