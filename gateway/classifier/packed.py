"""The vocabulary as sorted integer keys, scored with numpy: the classifier's walk for long texts when the C
extension did not build, and a reference the C logit is tested against. Imported only then: numpy is ~15 MiB
resident that a gateway scoring through the extension does not need.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

from gateway.classifier.vocabulary import MAX_NGRAM, Alphabet, CharNgrams

IdArray = npt.NDArray[np.uint64]
FloatArray = npt.NDArray[np.float64]


class PackedVocabulary:
    """The vocabulary as sorted uint64 keys: an n-gram's characters as 16-bit ids, the first in the low bits.

    Ids start at 1, so a shorter n-gram's key has zero high slots that no longer one has; characters
    outside the vocabulary's alphabet get an id no key contains, so a key match is an exact n-gram match.
    With a text's ids laid out as uint16, the keys of all its n-grams are one unaligned uint64 view.
    """

    def __init__(self, text: CharNgrams, weights: Mapping[str, float]) -> None:
        alphabet = Alphabet(weights)
        self.text = text
        self.unknown = alphabet.unknown
        # a sentinel above any code point and a key never built: searchsorted never runs off the end
        self.alphabet = np.array([*map(ord, alphabet.chars), 0xFFFFFFFF], dtype=np.uint32)
        self.ascii_ids = np.frombuffer(alphabet.ascii_ids(), dtype="<u2").copy()
        keys = np.array([alphabet.key(gram) for gram in weights], np.uint64)
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
