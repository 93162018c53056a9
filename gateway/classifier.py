"""The complexity classifier: P(HQ needed) for a request, scored from a plain-JSON linear model."""

from __future__ import annotations

import functools
import json
import math
import operator
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from sklearn.utils import murmurhash3_32

from gateway.features import Features

FORMAT = "agent-gateway/classifier"
CALIBRATION_FORMAT = "agent-gateway/calibration"
FORMAT_VERSION = 1
DEFAULT_MODEL_PATH = Path(__file__).parent / "models" / "default.json"
DEFAULT_CALIBRATION_PATH = Path(__file__).parent / "models" / "default.calibration.json"

# sklearn's char analyzer collapses runs of whitespace (not single newlines) to one space.
_WHITE_SPACES = re.compile(r"\s\s+")
_C1 = np.uint32(0xCC9E2D51)
_C2 = np.uint32(0x1B873593)
_TAIL_MASKS = np.array([0, 0xFF, 0xFFFF, 0xFFFFFF], dtype=np.uint32)
# Below this many characters a memoized pure-Python loop beats numpy's fixed per-call cost (measured on
# MMLU prompt tails: 73 vs 113 µs at 60 characters, 319 vs 178 µs at 150, memo warm).
SHORT_TEXT_CHARS = 100
GRAM_MEMO_ENTRIES = 50_000  # about 6 MB

Int32Array = npt.NDArray[np.int32]
IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


class ModelFileError(ValueError):
    """A model or calibration file that is not a readable artifact of ours; the message names the file."""


def _log1p(value: float) -> float:
    return math.log1p(max(value, 0.0))


# The structured inputs a model may use, by the name stored in the artifact; each maps Features to a float.
NUMERIC_FEATURES: dict[str, Callable[[Features], float]] = {
    "prompt_tokens": lambda f: _log1p(f.prompt_tokens),
    "last_user_tokens": lambda f: _log1p(f.last_user_tokens),
    "history_tokens": lambda f: _log1p(f.history_tokens),
    "system_tokens": lambda f: _log1p(f.system_tokens),
    "message_count": lambda f: _log1p(f.message_count),
    "tools_count": lambda f: _log1p(f.tools_count),
    "tool_result_turns": lambda f: _log1p(f.tool_result_turns),
    "has_code": lambda f: float(f.has_code),
    "has_math": lambda f: float(f.has_math),
    "json_output": lambda f: float(f.response_format in ("json_object", "json_schema")),
    "max_tokens": lambda f: _log1p(f.max_tokens or 0),
}


def _rotl(x: npt.NDArray[np.uint32], r: int) -> npt.NDArray[np.uint32]:
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def murmurhash3_spans(data: bytes, starts: IntArray, lengths: IntArray) -> Int32Array:
    """MurmurHash3 x86 32-bit (seed 0, signed, as sklearn's murmurhash3_32) of many byte spans at once."""
    padded = data + b"\0\0\0\0"
    # An unaligned view: words[j] is the little-endian uint32 starting at byte j, so a block is one gather.
    words = np.ndarray((len(data) + 1,), dtype="<u4", buffer=padded, strides=(1,))
    last_word = len(data)
    h = np.zeros(len(starts), dtype=np.uint32)
    n_blocks = lengths >> 2
    for block in range(int(n_blocks.max(initial=0))):
        k = words[np.minimum(starts + 4 * block, last_word)] * _C1
        k = _rotl(k, 15) * _C2
        mixed = _rotl(h ^ k, 13) * np.uint32(5) + np.uint32(0xE6546B64)
        h = np.where(block < n_blocks, mixed, h)
    tail = words[np.minimum(starts + 4 * n_blocks, last_word)] & _TAIL_MASKS[lengths & 3]
    h ^= _rotl(tail * _C1, 15) * _C2  # an empty tail is 0 and leaves h unchanged
    h ^= lengths.astype(np.uint32)
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h.view(np.int32)


def fmix32(h: npt.NDArray[np.uint32]) -> Int32Array:
    """MurmurHash3's finalizer (in place), viewed as the signed hash sklearn returns."""
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h.view(np.int32)


@dataclass(frozen=True, slots=True)
class CharNgrams:
    """sklearn's HashingVectorizer(analyzer="char", alternate_sign=True, norm="l2") of a text head."""

    ngram_min: int
    ngram_max: int
    n_features: int
    lowercase: bool = True
    max_chars: int = 1_000  # hashing cost grows with the text: this bounds the score's cost
    tail_chars: int = 300

    def __post_init__(self) -> None:
        if self.n_features < 16 or self.n_features & (self.n_features - 1):
            raise ValueError(f"n_features must be a power of two >= 16, got {self.n_features}")
        if not 0 <= self.tail_chars <= self.max_chars:
            raise ValueError(f"tail_chars must be within [0, max_chars], got {self.tail_chars}")

    def clip(self, text: str) -> str:
        """At most max_chars: the head and the last tail_chars, where a long prompt's ask usually is."""
        if len(text) <= self.max_chars:
            return text
        return text[: self.max_chars - self.tail_chars] + text[len(text) - self.tail_chars :]

    def preprocess(self, text: str) -> str:
        """The text the n-grams are cut from, exactly as the training analyzer sees it."""
        text = self.clip(text)
        return _WHITE_SPACES.sub(" ", text.lower() if self.lowercase else text)

    def hashes(self, text: str) -> Int32Array:
        """Signed murmur hashes of every n-gram of the preprocessed text, in sklearn's order."""
        data = text.encode("utf-8", "surrogatepass")
        if len(data) == len(text):
            return self._ascii_hashes(data)
        # byte offset of each character start, so n-grams stay whole characters
        raw = np.frombuffer(data, dtype=np.uint8)
        offsets = np.append(np.flatnonzero((raw & 0xC0) != 0x80), len(data)).astype(np.int64)
        n_chars = len(offsets) - 1
        sizes = range(self.ngram_min, min(self.ngram_max, n_chars) + 1)
        if not sizes:
            return np.zeros(0, dtype=np.int32)
        starts = np.concatenate([offsets[: n_chars - n + 1] for n in sizes])
        ends = np.concatenate([offsets[n:] for n in sizes])
        return murmurhash3_spans(data, starts, ends - starts)

    def _ascii_hashes(self, data: bytes) -> Int32Array:
        """One byte per character: the keys of each n-gram size start at bytes 0, 1, 2, ... so blocks are
        slices of one unaligned view, and the block mixes are shared by all sizes that contain them."""
        words = np.ndarray((len(data) + 1,), dtype="<u4", buffer=data + b"\0\0\0\0", strides=(1,))
        sizes = range(self.ngram_min, min(self.ngram_max, len(data)) + 1)
        if not sizes:
            return np.zeros(0, dtype=np.int32)
        # mixed[b] = state after b blocks, for every start that has room for the longest size needing b
        mixed = [np.zeros(len(data), dtype=np.uint32)]
        for block in range(sizes[-1] // 4):
            count = len(data) - 4 * (block + 1) + 1
            k = _rotl(words[4 * block : 4 * block + count] * _C1, 15) * _C2
            mixed.append(_rotl(mixed[-1][:count] ^ k, 13) * np.uint32(5) + np.uint32(0xE6546B64))
        runs = []
        for n in sizes:
            count = len(data) - n + 1
            n_blocks, tail_length = divmod(n, 4)
            h = mixed[n_blocks][:count]
            if tail_length:
                tail = words[4 * n_blocks : 4 * n_blocks + count] & _TAIL_MASKS[tail_length]
                h = h ^ (_rotl(tail * _C1, 15) * _C2)
            runs.append(h ^ np.uint32(n))
        return fmix32(np.concatenate(runs))

    def columns(self, hashes: Int32Array) -> tuple[npt.NDArray[np.int32], FloatArray]:
        """Column index and sign of each hash, as sklearn's FeatureHasher maps them.

        n_features is a power of two, so abs() wrapping INT32_MIN onto itself still lands on column 0,
        which is where sklearn's special case puts it.
        """
        index = np.abs(hashes) & np.int32(self.n_features - 1)
        return index, np.where(hashes >= 0, 1.0, -1.0)

    def ngrams(self, text: str) -> list[str]:
        """The n-gram strings themselves, in sklearn's order (short texts and explanations)."""
        return list(map(text.__getitem__, self.slices(len(text))))

    def slices(self, n_chars: int) -> list[slice]:
        """The n-gram slices of a text of n_chars characters, memoized for short lengths."""
        if n_chars <= SHORT_TEXT_CHARS:
            return _slices(self.ngram_min, self.ngram_max, n_chars)
        return _slices.__wrapped__(self.ngram_min, self.ngram_max, n_chars)


@functools.lru_cache(maxsize=4 * SHORT_TEXT_CHARS)
def _slices(ngram_min: int, ngram_max: int, n_chars: int) -> list[slice]:
    return [slice(i, i + n) for n in range(ngram_min, ngram_max + 1) for i in range(n_chars - n + 1)]


def sigmoid(z: float) -> float:
    """The logistic function, safe for large |z|."""
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


class GramMemo(dict[str, tuple[int, int, float]]):
    """Memo of n-gram -> (column, column or ~column by sign, signed coefficient), for short texts."""

    def __init__(self, text: CharNgrams, coef: FloatArray) -> None:
        super().__init__()
        self.mask = text.n_features - 1
        self.coef = coef.tolist()  # a list index is several times cheaper than a numpy scalar read

    def __missing__(self, gram: str) -> tuple[int, int, float]:
        h = murmurhash3_32(gram.encode("utf-8", "surrogatepass"))
        column = abs(h) & self.mask
        weight = self.coef[column]
        # (column, column or ~column by sign, signed coefficient)
        entry = (column, column, weight) if h >= 0 else (column, ~column, -weight)
        if len(self) < GRAM_MEMO_ENTRIES:  # bounded: past it, misses are hashed each time
            self[gram] = entry
        return entry


_COLUMN = operator.itemgetter(0)
_SIGNED_COLUMN = operator.itemgetter(1)
_SIGNED_WEIGHT = operator.itemgetter(2)


def squared_norm(index: npt.NDArray[np.int32], negative: npt.NDArray[np.bool_]) -> float:
    """||x||^2 of the hashed count vector, with x[c] the sum of the signs of the n-grams in column c.

    One sort of int32 (column, sign) keys: several times cheaper than np.unique with an inverse.
    """
    keys = np.sort((index << 1) | negative)
    bounds = np.concatenate(([0], np.flatnonzero(keys[1:] != keys[:-1]) + 1, [len(keys)]))
    counts = np.diff(bounds)
    columns = keys[bounds[:-1]] >> 1
    same_column = columns[1:] == columns[:-1]
    if not same_column.any():
        return float(counts.dot(counts))
    # a column holds n-grams of both signs: sum each column's signed counts first
    signed = np.where(keys[bounds[:-1]] & 1, -counts, counts)
    values = np.add.reduceat(signed, np.flatnonzero(np.concatenate(([True], ~same_column))))
    return float(values.dot(values))


@dataclass(frozen=True, slots=True)
class NumericInput:
    """One structured input: a NUMERIC_FEATURES name, standardized with the training mean and scale."""

    name: str
    mean: float
    scale: float
    coef: float

    def contribution(self, features: Features) -> float:
        return self.coef * (NUMERIC_FEATURES[self.name](features) - self.mean) / self.scale


class Classifier:
    """A logistic model over hashed character n-grams of the last user turn plus structured inputs."""

    def __init__(
        self,
        text: CharNgrams,
        text_coef: FloatArray,
        numeric: Sequence[NumericInput],
        intercept: float,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        self.text = text
        self.text_coef = text_coef
        self.numeric: tuple[NumericInput, ...] = tuple(numeric)
        self.intercept = intercept
        self.meta = dict(meta or {})
        self._gram_memo = GramMemo(text, text_coef)

    @classmethod
    def load(cls, path: str | Path) -> Classifier:
        """Read a plain-JSON artifact; anything else (a pickle, a truncated file) is a ModelFileError."""
        return cls.from_dict(read_json(path, FORMAT), str(path))

    @classmethod
    def default(cls) -> Classifier:
        """The model shipped in gateway/models/default.json."""
        return cls.load(DEFAULT_MODEL_PATH)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], source: str = "<dict>") -> Classifier:
        try:
            spec = doc["text"]
            text = CharNgrams(
                ngram_min=int(spec["ngram_min"]),
                ngram_max=int(spec["ngram_max"]),
                n_features=int(spec["n_features"]),
                lowercase=bool(spec["lowercase"]),
                max_chars=int(spec["max_chars"]),
                tail_chars=int(spec["tail_chars"]),
            )
            coef = np.zeros(text.n_features, dtype=np.float64)
            coef[np.asarray(doc["text_coef"]["index"], dtype=np.int64)] = doc["text_coef"]["value"]
            numeric = [
                NumericInput(str(n["name"]), float(n["mean"]), float(n["scale"]), float(n["coef"]))
                for n in doc["numeric"]
            ]
            intercept = float(doc["intercept"])
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ModelFileError(f"{source}: not a valid classifier artifact: {exc!r}") from exc
        unknown = [n.name for n in numeric if n.name not in NUMERIC_FEATURES]
        if unknown:
            raise ModelFileError(f"{source}: unknown numeric feature(s) {unknown}")
        return cls(text, coef, numeric, intercept, doc.get("meta"))

    def to_dict(self) -> dict[str, Any]:
        """The artifact: settings, the nonzero text coefficients (sparse) and the structured inputs."""
        nonzero = np.flatnonzero(self.text_coef)
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "text": {
                "analyzer": "char",
                "ngram_min": self.text.ngram_min,
                "ngram_max": self.text.ngram_max,
                "n_features": self.text.n_features,
                "lowercase": self.text.lowercase,
                "max_chars": self.text.max_chars,
                "tail_chars": self.text.tail_chars,
                "alternate_sign": True,
                "norm": "l2",
            },
            "intercept": self.intercept,
            "numeric": [
                {"name": n.name, "mean": n.mean, "scale": n.scale, "coef": n.coef} for n in self.numeric
            ],
            "text_coef": {
                "index": nonzero.tolist(),
                "value": [float(f"{v:.6g}") for v in self.text_coef[nonzero]],
            },
            "meta": self.meta,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), separators=(",", ":")) + "\n", encoding="utf-8")

    def text_logit(self, text: str) -> float:
        """The text block's contribution to the logit: coef . x / ||x||, x the signed n-gram counts."""
        text = self.text.preprocess(text)
        if len(text) <= SHORT_TEXT_CHARS:
            return self._short_text_logit(self.text.ngrams(text))
        hashes = self.text.hashes(text)
        index, signs = self.text.columns(hashes)
        norm = math.sqrt(squared_norm(index, hashes < 0))
        return float(self.text_coef[index].dot(signs)) / norm if norm else 0.0

    def text_vector(self, text: str) -> tuple[IntArray, FloatArray]:
        """The nonzero columns of sklearn's hashed count vector of a preprocessed text, and their values."""
        hashes = self.text.hashes(text)
        index, signs = self.text.columns(hashes)
        columns, inverse = np.unique(index, return_inverse=True)
        values = np.bincount(inverse, weights=signs, minlength=len(columns)).astype(np.float64)
        return columns.astype(np.int64), values

    def _short_text_logit(self, grams: list[str]) -> float:
        """text_logit for a few n-grams; map/itemgetter/Counter keep the per-n-gram work in C."""
        entries = list(map(self._gram_memo.__getitem__, grams))
        dot = sum(map(_SIGNED_WEIGHT, entries))
        if len(set(map(_COLUMN, entries))) == len(entries):
            # The usual short text: every n-gram in a column of its own, so each count is 1.
            return dot / math.sqrt(len(entries)) if entries else 0.0
        counts = Counter(map(_SIGNED_COLUMN, entries))  # repeats of an n-gram add up before squaring
        if len(counts) == len(set(map(_COLUMN, entries))):  # no column holds n-grams of both signs
            norm2 = sum(map(operator.mul, counts.values(), counts.values()))
        else:
            values: dict[int, int] = {}
            for code, count in counts.items():
                column, sign = (code, 1) if code >= 0 else (~code, -1)
                values[column] = values.get(column, 0) + sign * count
            norm2 = sum(v * v for v in values.values())
        return dot / math.sqrt(norm2) if norm2 else 0.0

    def logit(self, features: Features) -> float:
        z = self.intercept + self.text_logit(features.last_user_text)
        return z + sum(n.contribution(features) for n in self.numeric if n.coef)

    def score(self, features: Features) -> float:
        """P(HQ needed): the probability that the fast deployment's answer would be worse than HQ's."""
        return sigmoid(self.logit(features))

    def explain(self, features: Features, top: int = 5) -> list[tuple[str, float]]:
        """The inputs that moved the logit most, as (readable name, logit contribution), largest |c| first."""
        contributions: dict[str, float] = {}
        for n in self.numeric:
            if n.coef:
                contributions[n.name] = n.contribution(features)
        text = self.text.preprocess(features.last_user_text)
        grams = self.text.ngrams(text)
        if grams:
            _, values = self.text_vector(text)
            norm = math.sqrt(float(values.dot(values))) or 1.0
            index, sign = self.text.columns(self.text.hashes(text))
            weights = self.text_coef[index] * sign / norm
            for gram, weight in zip(grams, weights.tolist(), strict=True):
                key = f"char:{gram!r}"
                contributions[key] = contributions.get(key, 0.0) + weight
        ranked = sorted(contributions.items(), key=lambda item: -abs(item[1]))
        return [(name, round(value, 4)) for name, value in ranked[:top]]


def read_json(path: str | Path, expected_format: str) -> dict[str, Any]:
    """A JSON object of the expected format; never unpickles or executes anything."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot read: {exc.strerror}") from exc
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        hint = " (it looks like a pickle; only JSON artifacts load)" if raw[:1] == b"\x80" else ""
        raise ModelFileError(f"{path}: not a JSON artifact{hint}: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != expected_format:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ModelFileError(f"{path}: format is {found!r}, expected {expected_format!r}")
    if doc.get("version") != FORMAT_VERSION:
        raise ModelFileError(f"{path}: version {doc.get('version')!r} is not {FORMAT_VERSION}")
    return doc


@dataclass(frozen=True, slots=True)
class Calibration:
    """Score quantiles of reference traffic: which threshold sends a given share of it to HQ."""

    scores: tuple[float, ...]  # sorted ascending, a sample (or quantiles) of scores on reference traffic
    meta: Mapping[str, Any]

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        doc = read_json(path, CALIBRATION_FORMAT)
        try:
            scores = tuple(sorted(float(s) for s in doc["scores"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelFileError(f"{path}: field 'scores' must be a list of numbers: {exc}") from exc
        if not scores:
            raise ModelFileError(f"{path}: field 'scores' is empty")
        return cls(scores, doc.get("meta", {}))

    @classmethod
    def default(cls) -> Calibration:
        return cls.load(DEFAULT_CALIBRATION_PATH)

    @classmethod
    def from_scores(
        cls, scores: Sequence[float], meta: Mapping[str, Any] | None = None, points: int = 1001
    ) -> Calibration:
        """Keep `points` quantiles of the scores: enough resolution, a small file."""
        quantiles = np.quantile(np.asarray(scores, dtype=np.float64), np.linspace(0.0, 1.0, points))
        return cls(tuple(float(f"{q:.6g}") for q in quantiles), dict(meta or {}))

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": CALIBRATION_FORMAT,
            "version": FORMAT_VERSION,
            "scores": list(self.scores),
            "meta": dict(self.meta),
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), separators=(",", ":")) + "\n", encoding="utf-8")

    def threshold_for_share(self, hq_share: float) -> float:
        """The score threshold t such that about hq_share of the reference traffic has score >= t."""
        share = min(max(hq_share, 0.0), 1.0)
        if share <= 0.0:
            return math.nextafter(self.scores[-1], math.inf)  # nothing reaches it
        return float(np.quantile(np.asarray(self.scores), 1.0 - share))

    def share_for_threshold(self, threshold: float) -> float:
        """The share of reference traffic whose score is >= threshold."""
        scores = np.asarray(self.scores)
        return float(np.mean(scores >= threshold))
