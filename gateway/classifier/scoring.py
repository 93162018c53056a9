"""The complexity classifier: P(HQ needed) for a request, scored from a plain-JSON linear model."""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.classifier.cues import NO_CUES, Cues, read_cues
from gateway.classifier.inputs import FEATURES_ONLY, INPUTS, compile_terms
from gateway.classifier.ngrams import NgramWeights
from gateway.classifier.vocabulary import CharNgrams
from gateway.features import Features

FORMAT = "agent-gateway/classifier"
CALIBRATION_FORMAT = "agent-gateway/calibration"
# 2: a vocabulary of n-grams with a weight each (1 hashed n-grams into columns; its files need retraining)
MODEL_VERSION = 2
CALIBRATION_VERSION = 1
DEFAULT_MODEL_PATH = Path(__file__).parent / "models" / "default.json"
DEFAULT_CALIBRATION_PATH = Path(__file__).parent / "models" / "default.calibration.json"

if TYPE_CHECKING:  # numpy is for training and evaluation; the serving path never imports it, nor holds its memory
    import numpy as np
    import numpy.typing as npt

    FloatArray = npt.NDArray[np.float64]


class ModelFileError(ValueError):
    """A model or calibration file that is not a readable artifact of ours; the message names the file."""


def sigmoid(z: float) -> float:
    """The logistic function, safe for large |z|."""
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


@dataclass(frozen=True, slots=True)
class NumericInput:
    """One structured input: an INPUTS name, standardized with the training mean and scale.

    A value outside the range seen in training is read as the nearest end of it: a linear model extrapolates
    without limit, and a request unlike any training prompt (two characters, 100k tokens) should get no
    more weight than the most extreme one it learned from.
    """

    name: str
    mean: float
    scale: float
    coef: float
    low: float = -math.inf
    high: float = math.inf

    def value(self, features: Features, cues: Cues) -> float:
        return min(max(INPUTS[self.name](features, cues), self.low), self.high)

    def contribution(self, features: Features, cues: Cues) -> float:
        return self.coef * (self.value(features, cues) - self.mean) / self.scale


class Classifier:
    """A logistic model over the character n-grams of the last user turn plus structured inputs."""

    def __init__(
        self,
        text: CharNgrams,
        text_weights: Mapping[str, float],
        numeric: Sequence[NumericInput],
        intercept: float,
        meta: Mapping[str, Any] | None = None,
        text_mean: float = 0.0,
        read_back: Callable[[], Mapping[str, float]] | None = None,
    ) -> None:
        self.text = text
        self.text_block = NgramWeights(text, text_weights, read_back)
        self.numeric: tuple[NumericInput, ...] = tuple(numeric)
        self.intercept = intercept
        self.meta = dict(meta or {})
        # A text with no vocabulary n-gram ("hi") reads as the average training text, not as a text logit of
        # 0, which would set it apart from every prompt the model learned from (their mean is not 0).
        self.text_mean = text_mean
        # the inputs that move the logit, (name, mean, coef / scale, range), summed by one compiled function
        self._terms = compile_terms([(n.name, n.mean, n.coef / n.scale, n.low, n.high) for n in self.numeric if n.coef])
        # the cues cost CPU on each request that reads them: read only by a model with a weight on an input that
        # needs them
        self.reads_cues = any(n.coef and n.name not in FEATURES_ONLY for n in self.numeric)

    @property
    def text_weights(self) -> dict[str, float]:
        """The weight of each vocabulary n-gram, in the training matrix's column order."""
        return self.text_block.weights

    @classmethod
    def load(cls, path: str | Path) -> Classifier:
        """Read a plain-JSON artifact; anything else (a pickle, a truncated file) is a ModelFileError. Its n-gram
        weights are read back from the file when an explanation needs them (NgramWeights)."""
        loaded = _stamp(path)

        def read_back() -> dict[str, float]:
            if _stamp(path) != loaded:
                raise ModelFileError(f"{path}: changed since the gateway loaded it; restart it to explain with it")
            return _text_weights(read_json(path, FORMAT, MODEL_VERSION))

        return cls.from_dict(read_json(path, FORMAT, MODEL_VERSION), str(path), read_back)

    @classmethod
    def default(cls) -> Classifier:
        """The model shipped in gateway/classifier/models/default.json."""
        return cls.load(DEFAULT_MODEL_PATH)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], source: str = "<dict>",
                  read_back: Callable[[], Mapping[str, float]] | None = None) -> Classifier:
        try:
            spec = doc["text"]
            text = CharNgrams(
                ngram_min=int(spec["ngram_min"]),
                ngram_max=int(spec["ngram_max"]),
                lowercase=bool(spec["lowercase"]),
                max_chars=int(spec["max_chars"]),
                tail_chars=int(spec["tail_chars"]),
            )
            weights = _text_weights(doc)
            numeric = [
                NumericInput(
                    str(n["name"]),
                    float(n["mean"]),
                    float(n["scale"]),
                    float(n["coef"]),
                    float(n.get("low", -math.inf)),  # artifacts trained before ranges were kept
                    float(n.get("high", math.inf)),
                )
                for n in doc["numeric"]
            ]
            intercept = float(doc["intercept"])
            text_mean = float(doc.get("text_mean", 0.0))  # 0: an artifact from before it was kept
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ModelFileError(f"{source}: not a valid classifier artifact: {exc!r}") from exc
        unknown = [n.name for n in numeric if n.name not in INPUTS]
        if unknown:
            raise ModelFileError(f"{source}: unknown numeric feature(s) {unknown}")
        return cls(text, weights, numeric, intercept, doc.get("meta"), text_mean, read_back)

    def to_dict(self) -> dict[str, Any]:
        """The artifact: settings, the vocabulary with its weights and the structured inputs."""
        return {
            "format": FORMAT,
            "version": MODEL_VERSION,
            "text": {
                "analyzer": "char",
                "ngram_min": self.text.ngram_min,
                "ngram_max": self.text.ngram_max,
                "lowercase": self.text.lowercase,
                "max_chars": self.text.max_chars,
                "tail_chars": self.text.tail_chars,
                "norm": "l2",
            },
            "intercept": self.intercept,
            "text_mean": self.text_mean,
            "numeric": [_numeric_entry(n) for n in self.numeric],
            "text_weights": {gram: float(f"{w:.6g}") for gram, w in self.text_weights.items()},
            "meta": self.meta,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), separators=(",", ":")) + "\n", encoding="utf-8")

    def text_logit(self, text: str) -> float:
        """The text block's contribution to the logit: w . x / ||x||, x the text's vocabulary n-gram counts,
        or text_mean for a text with none (the walks return exactly 0.0 then)."""
        logit = self.text_block.logit(text)
        return logit if logit != 0.0 else self.text_mean

    def cues(self, features: Features) -> Cues:
        """The request's cues, or the empty cues when no input with a weight reads them."""
        return read_cues(features) if self.reads_cues else NO_CUES

    def logit(self, features: Features) -> float:
        return self._terms(features, self.cues(features), self.intercept + self.text_logit(features.last_user_text))

    def score(self, features: Features) -> float:
        """P(HQ needed): an estimate of the probability that the fast deployment's answer is worse than HQ's."""
        return sigmoid(self.logit(features))

    def explain(self, features: Features, top: int = 5) -> list[tuple[str, float]]:
        """The inputs that moved the logit most, as (readable name, logit contribution), largest |c| first."""
        cues = self.cues(features)
        contributions = {n.name: n.contribution(features, cues) for n in self.numeric if n.coef}
        grams = self.text_block.contributions(features.last_user_text)
        for gram, weight in grams.items():
            contributions[f"char:{gram!r}"] = weight
        if not grams:
            contributions["text: no known n-gram, read as the average"] = self.text_mean
        ranked = sorted(contributions.items(), key=lambda item: -abs(item[1]))
        return [(name, round(value, 4)) for name, value in ranked[:top]]


def _text_weights(doc: Mapping[str, Any]) -> dict[str, float]:
    return {str(gram): float(weight) for gram, weight in doc["text_weights"].items()}


def _stamp(path: str | Path) -> tuple[int, int] | None:
    """The file's size and modification time: what says it is the artifact the weights were read from."""
    try:
        found = Path(path).stat()
    except OSError:
        return None
    return found.st_size, found.st_mtime_ns


def _numeric_entry(n: NumericInput) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": n.name, "mean": n.mean, "scale": n.scale, "coef": n.coef}
    entry.update({k: v for k, v in (("low", n.low), ("high", n.high)) if math.isfinite(v)})  # JSON has no inf
    return entry


def read_json(path: str | Path, expected_format: str, expected_version: int) -> dict[str, Any]:
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
    if doc.get("version") != expected_version:
        raise ModelFileError(
            f"{path}: version {doc.get('version')!r} is not {expected_version}; "
            "retrain or recalibrate it with `agent-gateway classifier`"
        )
    return doc


@dataclass(frozen=True, slots=True)
class Calibration:
    """Score quantiles of reference traffic: which threshold sends a given share of it to HQ."""

    scores: tuple[float, ...]  # sorted ascending, a sample (or quantiles) of scores on reference traffic
    meta: Mapping[str, Any]

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        doc = read_json(path, CALIBRATION_FORMAT, CALIBRATION_VERSION)
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
        import numpy as np

        quantiles = np.quantile(np.asarray(scores, dtype=np.float64), np.linspace(0.0, 1.0, points))
        return cls(tuple(float(f"{q:.6g}") for q in quantiles), dict(meta or {}))

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": CALIBRATION_FORMAT,
            "version": CALIBRATION_VERSION,
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
        return quantile(self.scores, 1.0 - share)

    def share_for_threshold(self, threshold: float) -> float:
        """The share of reference traffic whose score is >= threshold."""
        return (len(self.scores) - bisect.bisect_left(self.scores, threshold)) / len(self.scores)


def quantile(ascending: Sequence[float], q: float) -> float:
    """The q-quantile of sorted values, interpolated exactly as numpy.quantile's default ("linear") does."""
    position = q * (len(ascending) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ascending) - 1)
    low, high, t = ascending[below], ascending[above], position - below
    # numpy's lerp: from the nearer end, so that t = 1 gives `high` exactly
    return low + (high - low) * t if t < 0.5 else high - (high - low) * (1 - t)
