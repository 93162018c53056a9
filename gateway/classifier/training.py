"""Training and RouteLLM-style evaluation of the complexity classifier (scikit-learn, off the hot path)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp
from sklearn.feature_extraction.text import CountVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import GroupKFold
from sklearn.preprocessing import normalize

from gateway.classifier.ngrams import CharNgrams
from gateway.classifier.options import DEFAULT_OPTIONS, TrainingOptions
from gateway.classifier.scoring import NUMERIC_FEATURES, Classifier, FloatArray, NumericInput
from gateway.features import Features

MIN_STD = 1e-9  # a structured input that varies less than this in training is a constant there
LENGTH_INPUT = "last_user_tokens"
LENGTH_BOOSTS = tuple(round(0.1 * i, 1) for i in range(0, 16))
CURVE_POINTS = 10  # RouteLLM: thresholds at the score's deciles
RANDOM_SEEDS = 10

Progress = Callable[[str], None]




def _quiet(_: str) -> None:
    pass


@dataclass(frozen=True, slots=True)
class Example:
    """One labelled prompt: its request features and the quality of each deployment's answer."""

    features: Features
    q_strong: float
    q_weak: float
    group: str = ""
    prompt_chars: int = 0
    weight: float = 1.0  # in the log loss, relative to a CSV row (`classifier train --labels-weight`)


def labels(examples: Sequence[Example]) -> npt.NDArray[np.int64]:
    """1 where the fast deployment's answer is worse than HQ's (q_strong > q_weak)."""
    return np.array([int(e.q_strong > e.q_weak) for e in examples], dtype=np.int64)


def vectorizer(text: CharNgrams, vocabulary: Sequence[str] | None = None, min_df: int = 1) -> CountVectorizer:
    """The scikit-learn twin of CharNgrams: n-gram counts over a fixed vocabulary, or one to learn."""
    return CountVectorizer(
        analyzer="char",
        ngram_range=(text.ngram_min, text.ngram_max),
        lowercase=text.lowercase,
        vocabulary=vocabulary,
        min_df=min_df,
        dtype=np.float64,
    )


def learn_vocabulary(text: CharNgrams, texts: Sequence[str], min_df: int) -> list[str]:
    """The n-grams found in at least min_df of the (clipped) texts, sorted for a stable artifact."""
    counts = vectorizer(text, min_df=min_df).fit([text.clip(t) for t in texts])
    return sorted(counts.vocabulary_)


def text_matrix(text: CharNgrams, vocabulary: Sequence[str], texts: Sequence[str]) -> sp.csr_matrix:
    """L2-normalized vocabulary n-gram counts of each text, clipped as the scorer clips it."""
    counts = vectorizer(text, vocabulary).transform([text.clip(t) for t in texts])
    return sp.csr_matrix(normalize(counts, norm="l2"))


def numeric_matrix(features: Sequence[Features], names: Sequence[str]) -> FloatArray:
    """The raw structured inputs (before standardization), one column per name."""
    return np.array([[NUMERIC_FEATURES[n](f) for n in names] for f in features], dtype=np.float64)


def design_matrix(model: Classifier, features: Sequence[Features]) -> sp.csr_matrix:
    """The matrix scikit-learn sees for these requests: [text block | standardized structured inputs]."""
    names = [n.name for n in model.numeric]
    raw = numeric_matrix(features, names)
    means = np.array([n.mean for n in model.numeric])
    scales = np.array([n.scale for n in model.numeric])
    texts = [f.last_user_text for f in features]
    text_block = text_matrix(model.text, list(model.text_weights), texts)
    return sp.hstack([text_block, sp.csr_matrix((raw - means) / scales)]).tocsr()


@dataclass(slots=True)
class Fitted:
    """A trained artifact and the scikit-learn estimator it came from (kept for equality tests)."""

    model: Classifier
    estimator: LogisticRegression
    design: sp.csr_matrix = field(repr=False)


def fit(examples: Sequence[Example], options: TrainingOptions = DEFAULT_OPTIONS) -> Fitted:
    """Logistic regression on char n-gram counts (a vocabulary learned from these rows) plus standardized
    structured inputs."""
    features = [e.features for e in examples]
    y = labels(examples)
    if len(set(y.tolist())) < 2:
        raise ValueError("training needs both outcomes: some rows with q_strong > q_weak and some without")
    vocabulary = learn_vocabulary(options.text, [f.last_user_text for f in features], options.min_df)
    raw = numeric_matrix(features, options.numeric)
    skeleton = Classifier(options.text, dict.fromkeys(vocabulary, 0.0), standardized(raw, options), 0.0)
    design = design_matrix(skeleton, features)
    fast_wins = np.array([e.q_weak > e.q_strong for e in examples])
    estimator = LogisticRegression(C=options.c, max_iter=3000)
    row_weights = np.array([e.weight for e in examples])
    estimator.fit(design, y, sample_weight=np.where(fast_wins, options.fast_wins_weight, 1.0) * row_weights)
    coef = estimator.coef_[0].tolist()
    # an input that never varied in training has nothing to say: its weight is the solver's rounding
    # residue, and a zero weight spares the scorer its lookup
    varied = raw.std(axis=0) > MIN_STD
    numeric = [
        NumericInput(n.name, n.mean, n.scale, w if varies else 0.0)
        for n, w, varies in zip(skeleton.numeric, coef[len(vocabulary) :], varied.tolist(), strict=True)
    ]
    meta = {
        "target": "q_strong > q_weak",
        "rows": len(examples),
        "positives": int(y.sum()),
        "fast_wins": int(fast_wins.sum()),
        "C": options.c,
        "numeric_weight": options.numeric_weight,
        "fast_wins_weight": options.fast_wins_weight,
        "min_df": options.min_df,
        "vocabulary": len(vocabulary),
    }
    weights = dict(zip(vocabulary, coef[: len(vocabulary)], strict=True))
    model = Classifier(options.text, weights, numeric, float(estimator.intercept_[0]), meta)
    return Fitted(model, estimator, design)


def standardized(raw: FloatArray, options: TrainingOptions) -> list[NumericInput]:
    """Each structured input with its training mean and scale (and no weight yet)."""
    stds = raw.std(axis=0)
    scales = np.where(stds > MIN_STD, stds, 1.0) / options.numeric_weight
    return [
        NumericInput(name, float(mean), float(scale), 0.0)
        for name, mean, scale in zip(options.numeric, raw.mean(axis=0), scales, strict=True)
    ]


def cross_validate(
    examples: Sequence[Example], folds: int, progress: Progress = _quiet, options: TrainingOptions = DEFAULT_OPTIONS
) -> FloatArray:
    """Out-of-fold scores, whole groups held out together (GroupKFold), scored by our own scorer."""
    groups = [e.group or f"row{i}" for i, e in enumerate(examples)]
    scores = np.zeros(len(examples))
    splitter = GroupKFold(n_splits=folds)
    for k, (train, test) in enumerate(splitter.split(np.zeros(len(examples)), groups=groups), start=1):
        progress(f"fold {k}/{folds}: training on {len(train)} rows, scoring {len(test)}")
        model = fit([examples[i] for i in train], options).model
        scores[test] = [model.score(examples[i].features) for i in test]
    return scores


def boosted(scores: FloatArray, examples: Sequence[Example], boost: float) -> FloatArray:
    """Scores with `boost` added to the logit per standard deviation of log last-user tokens."""
    lengths = np.log1p([max(e.features.last_user_tokens, 0) for e in examples])
    std = float(lengths.std()) or 1.0
    clipped = np.clip(scores, 1e-12, 1 - 1e-12)
    logits = np.log(clipped / (1 - clipped)) + boost * (lengths - lengths.mean()) / std
    return np.asarray(1.0 / (1.0 + np.exp(-logits)), dtype=np.float64)


def tune_length_boost(scores: FloatArray, examples: Sequence[Example]) -> tuple[float, FloatArray]:
    """The length boost with the best APGR on out-of-fold scores, and the boosted scores.

    Log loss spreads weight over thousands of n-gram columns and leaves prompt length, the input that
    transfers best to unseen topics, underweighted for ranking; one extra parameter, tuned on held-out
    scores, puts it back.
    """
    q_strong = np.array([e.q_strong for e in examples])
    q_weak = np.array([e.q_weak for e in examples])
    strong, weak = float(q_strong.mean()), float(q_weak.mean())

    def apgr(boost: float) -> float:
        return summarize(routing_curve(boosted(scores, examples, boost), q_strong, q_weak), strong, weak).apgr

    best = max(LENGTH_BOOSTS, key=apgr)
    return best, boosted(scores, examples, best)


def with_length_boost(model: Classifier, examples: Sequence[Example], boost: float) -> Classifier:
    """The model with the boost folded into its coefficient for LENGTH_INPUT (same units as boosted())."""
    lengths = np.log1p([max(e.features.last_user_tokens, 0) for e in examples])
    mean, std = float(lengths.mean()), float(lengths.std()) or 1.0
    numeric = list(model.numeric)
    intercept = model.intercept
    for i, n in enumerate(numeric):
        if n.name == LENGTH_INPUT:
            # contribution = coef * (x - n.mean) / n.scale; the boost adds boost * (x - mean) / std
            numeric[i] = NumericInput(n.name, n.mean, n.scale, n.coef + boost * n.scale / std)
            intercept += boost * (n.mean - mean) / std
    return Classifier(model.text, model.text_weights, numeric, intercept, {**model.meta, "length_boost": boost})


@dataclass(frozen=True, slots=True)
class Curve:
    """Quality against HQ share, one point per threshold, sorted by share."""

    hq_share: FloatArray
    quality: FloatArray
    thresholds: FloatArray


def routing_curve(
    scores: FloatArray, q_strong: FloatArray, q_weak: FloatArray, points: int = CURVE_POINTS
) -> Curve:
    """RouteLLM's sweep: thresholds at the score quantiles; route to HQ where score >= threshold."""
    thresholds = np.quantile(scores, np.linspace(0.0, 1.0, points + 1))
    rows = []
    for i, threshold in enumerate(thresholds):
        # the last threshold uses '>' so the sweep always ends at 0% HQ
        to_hq = scores >= threshold if i < points else scores > threshold
        rows.append((float(to_hq.mean()), float(np.where(to_hq, q_strong, q_weak).mean()), float(threshold)))
    rows.sort()
    table = np.array(rows)
    return Curve(table[:, 0], table[:, 1], table[:, 2])


@dataclass(frozen=True, slots=True)
class Summary:
    """RouteLLM figures: average performance gap recovered, and HQ share needed for 50% / 80% of the gap."""

    apgr: float
    cpt50: float
    cpt80: float


def summarize(curve: Curve, strong: float, weak: float) -> Summary:
    """APGR = area between the curve and the weak line over the strong-weak gap; CPT by interpolation."""
    span = curve.hq_share[-1] - curve.hq_share[0]
    gap = strong - weak
    if span <= 0 or gap == 0:
        return Summary(math.nan, math.nan, math.nan)
    area = float(np.trapezoid(curve.quality, curve.hq_share))
    apgr = (area - weak * span) / (gap * span)
    # np.interp as RouteLLM does: quality treated as increasing in HQ share
    cpt = [float(np.interp(weak + x * gap, curve.quality, curve.hq_share)) for x in (0.5, 0.8)]
    return Summary(apgr, cpt[0], cpt[1])


def compare_routers(
    scores: FloatArray, examples: Sequence[Example], seed: int = 0
) -> dict[str, tuple[Summary, Curve]]:
    """The classifier beside a random router (mean of several seeds) and a prompt-length router."""
    q_strong = np.array([e.q_strong for e in examples])
    q_weak = np.array([e.q_weak for e in examples])
    strong, weak = float(q_strong.mean()), float(q_weak.mean())
    out: dict[str, tuple[Summary, Curve]] = {}
    curve = routing_curve(scores, q_strong, q_weak)
    out["classifier"] = (summarize(curve, strong, weak), curve)
    rng = np.random.default_rng(seed)
    randoms = [routing_curve(rng.random(len(examples)), q_strong, q_weak) for _ in range(RANDOM_SEEDS)]
    figures = np.array([astuple(summarize(c, strong, weak)) for c in randoms])
    out["random"] = (Summary(*figures.mean(axis=0).tolist()), randoms[0])
    lengths = np.array([e.prompt_chars for e in examples], dtype=np.float64)
    curve = routing_curve(lengths, q_strong, q_weak)
    out["prompt length"] = (summarize(curve, strong, weak), curve)
    return out


def astuple(summary: Summary) -> tuple[float, float, float]:
    return (summary.apgr, summary.cpt50, summary.cpt80)


def report(results: dict[str, tuple[Summary, Curve]], strong: float, weak: float) -> list[str]:
    """The figures as aligned text lines."""
    lines = [
        f"HQ-only quality {strong:.4f}, fast-only quality {weak:.4f} (gap {strong - weak:.4f})",
        f"{'router':<16}{'APGR':>8}{'CPT(50%)':>11}{'CPT(80%)':>11}",
    ]
    for name, (summary, _) in results.items():
        lines.append(f"{name:<16}{summary.apgr:>8.3f}{summary.cpt50:>10.1%}{summary.cpt80:>11.1%}")
    return lines


def plot(results: dict[str, tuple[Summary, Curve]], strong: float, weak: float, path: str | Path) -> None:
    """Quality against HQ share for each router, with the HQ-only and fast-only lines (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, (summary, curve) in results.items():
        ax.plot(curve.hq_share * 100, curve.quality, marker=".", label=f"{name} (APGR {summary.apgr:.3f})")
    ax.axhline(strong, color="red", linestyle="--", label="HQ only")
    ax.axhline(weak, color="grey", linestyle="--", label="fast only")
    ax.set_xlabel("calls routed to HQ (%)")
    ax.set_ylabel("quality")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
