"""Training of the complexity classifier (scikit-learn, off the hot path): fits, cross-validation and
leave-one-benchmark-out scores."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import scipy.sparse as sp
from sklearn.feature_extraction.text import CountVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import GroupKFold
from sklearn.preprocessing import normalize

from gateway.classifier.cues import read_cues
from gateway.classifier.evaluation import FloatArray, routing_curve, summarize
from gateway.classifier.inputs import INPUTS
from gateway.classifier.options import DEFAULT_OPTIONS, TrainingOptions
from gateway.classifier.scoring import Classifier, NumericInput
from gateway.classifier.vocabulary import CharNgrams
from gateway.features import Features

MIN_STD = 1e-9  # a structured input that varies less than this in training is a constant there
LENGTH_INPUT = "ask_chars"
LENGTH_BOOSTS = tuple(round(0.1 * i, 1) for i in range(0, 16))

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


@dataclass(frozen=True, slots=True)
class Example:
    """One labelled prompt: its request features and the quality of each deployment's answer.

    `fail_share`, where given, is the share of a pool of models that answered wrongly: the label of rows
    whose file has no fast deployment of its own (q_strong and q_weak are then a pair picked to evaluate).
    """

    features: Features
    q_strong: float
    q_weak: float
    group: str = ""  # held out together: a cross-validation group, or the benchmark in leave-one-out
    prompt_chars: int = 0
    weight: float = 1.0  # in the log loss, relative to a CSV row (`classifier train --labels-weight`)
    dataset: str = ""
    fail_share: float | None = None


def targets(examples: Sequence[Example], options: TrainingOptions) -> tuple[FloatArray, FloatArray]:
    """The weight of each row as a positive (HQ needed) and as a negative, for a soft-label log loss (times
    the row's own weight).

    "fast-fails": P(the fast deployment's answer is wrong), 1 - q_weak, or the pool's fail share.
    "gap": P(HQ's answer is better): the gain q_strong - q_weak where positive, with rows where fast
    answered better weighing fast_wins_weight as negatives; rows with a fail share use it as in fast-fails.
    """
    pos, neg = np.zeros(len(examples)), np.zeros(len(examples))
    for i, e in enumerate(examples):
        if e.fail_share is not None or options.target == "fast-fails":
            pos[i] = e.fail_share if e.fail_share is not None else 1.0 - e.q_weak
            neg[i] = 1.0 - pos[i]
        else:
            gain = e.q_strong - e.q_weak
            pos[i] = max(gain, 0.0)
            neg[i] = 1.0 - pos[i] + (options.fast_wins_weight - 1.0) * max(-gain, 0.0)
    weights = np.array([e.weight for e in examples])
    return np.clip(pos, 0.0, None) * weights, np.clip(neg, 0.0, None) * weights


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
    if not vocabulary:  # a model without a text block
        return sp.csr_matrix((len(texts), 0))
    counts = vectorizer(text, vocabulary).transform([text.clip(t) for t in texts])
    return sp.csr_matrix(normalize(counts, norm="l2"))


def numeric_matrix(features: Sequence[Features], names: Sequence[str]) -> FloatArray:
    """The raw structured inputs (before standardization), one column per name."""
    inputs = [INPUTS[n] for n in names]
    rows = []
    for f in features:
        cues = read_cues(f)
        rows.append([value_of(f, cues) for value_of in inputs])
    return np.array(rows, dtype=np.float64).reshape(len(features), len(names))


def design_matrix(model: Classifier, features: Sequence[Features]) -> sp.csr_matrix:
    """The matrix scikit-learn sees for these requests: [text block | standardized structured inputs]."""
    names = [n.name for n in model.numeric]
    raw = numeric_matrix(features, names)
    means = np.array([n.mean for n in model.numeric])
    scales = np.array([n.scale for n in model.numeric])
    clipped = np.clip(raw, [n.low for n in model.numeric], [n.high for n in model.numeric])
    texts = [f.last_user_text for f in features]
    text_block = text_matrix(model.text, list(model.text_weights), texts)
    weights = np.fromiter(model.text_weights.values(), dtype=np.float64, count=text_block.shape[1])
    unknown = np.flatnonzero(text_block.getnnz(axis=1) == 0)
    if model.text_mean and len(unknown):
        # the scorer reads a text without vocabulary n-grams as text_mean: a row with w . row = text_mean
        text_block = sp.lil_matrix(text_block)
        text_block[unknown] = np.tile(model.text_mean * weights / weights.dot(weights), (len(unknown), 1))
    return sp.hstack([text_block, sp.csr_matrix((clipped - means) / scales)]).tocsr()


@dataclass(slots=True)
class Fitted:
    """A trained artifact and the scikit-learn estimator it came from (kept for equality tests)."""

    model: Classifier
    estimator: LogisticRegression
    design: sp.csr_matrix = field(repr=False)


def fit(examples: Sequence[Example], options: TrainingOptions = DEFAULT_OPTIONS) -> Fitted:
    """Logistic regression on char n-gram counts (a vocabulary learned from these rows) plus standardized
    structured inputs, with soft labels (see targets)."""
    features = [e.features for e in examples]
    pos, neg = targets(examples, options)
    if not pos.any() or not neg.any():
        raise ValueError("training needs both outcomes: some rows where HQ is needed and some where it is not")
    texts = [f.last_user_text for f in features]
    vocabulary = learn_vocabulary(options.text, texts, options.min_df) if options.use_text else []
    raw = numeric_matrix(features, options.numeric)
    skeleton = Classifier(options.text, dict.fromkeys(vocabulary, 0.0), standardized(raw, options), 0.0)
    design = design_matrix(skeleton, features)
    # a soft label is the row twice, once per outcome, each weighted; a row with one outcome appears once
    as_pos, as_neg = np.flatnonzero(pos > 0), np.flatnonzero(neg > 0)
    estimator = LogisticRegression(C=options.c, max_iter=3000)
    estimator.fit(
        sp.vstack([design[as_pos], design[as_neg]]).tocsr(),
        np.r_[np.ones(len(as_pos)), np.zeros(len(as_neg))],
        sample_weight=np.r_[pos[as_pos], neg[as_neg]],
    )
    coef = estimator.coef_[0].tolist()
    # an input that never varied in training has nothing to say: its weight is the solver's rounding
    # residue, and a zero weight spares the scorer its lookup
    varied = raw.std(axis=0) > MIN_STD
    numeric = [
        replace(n, coef=w if varies else 0.0)
        for n, w, varies in zip(skeleton.numeric, coef[len(vocabulary) :], varied.tolist(), strict=True)
    ]
    meta = {
        "target": options.target,
        "rows": len(examples),
        "positive_weight": round(float(pos.sum()), 3),
        "C": options.c,
        "numeric_weight": options.numeric_weight,
        "fast_wins_weight": options.fast_wins_weight,
        "min_df": options.min_df,
        "vocabulary": len(vocabulary),
    }
    weights = dict(zip(vocabulary, coef[: len(vocabulary)], strict=True))
    text_logits = design[:, : len(vocabulary)] @ np.asarray(coef[: len(vocabulary)])
    known = design[:, : len(vocabulary)].getnnz(axis=1) > 0
    text_mean = float(text_logits[known].mean()) if known.any() else 0.0
    model = Classifier(options.text, weights, numeric, float(estimator.intercept_[0]), meta, text_mean)
    return Fitted(model, estimator, design)


def standardized(raw: FloatArray, options: TrainingOptions) -> list[NumericInput]:
    """Each structured input with its training mean, scale and range (and no weight yet)."""
    stds = raw.std(axis=0)
    scales = np.where(stds > MIN_STD, stds, 1.0) / options.numeric_weight
    lows, highs = (raw.min(axis=0), raw.max(axis=0)) if len(raw) else (np.zeros(0), np.zeros(0))
    return [
        NumericInput(name, float(mean), float(scale), 0.0, float(low), float(high))
        for name, mean, scale, low, high in zip(options.numeric, raw.mean(axis=0), scales, lows, highs, strict=True)
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


def hold_out_each(
    examples: Sequence[Example], progress: Progress = _quiet, options: TrainingOptions = DEFAULT_OPTIONS
) -> FloatArray:
    """Leave-one-group-out scores: each group's rows scored by a model fitted on all the other groups'.

    With benchmarks as groups, a benchmark is scored by a model that never saw it (nor its vocabulary).
    """
    groups = sorted({e.group for e in examples})
    scores = np.zeros(len(examples))
    for k, group in enumerate(groups, start=1):
        test = [i for i, e in enumerate(examples) if e.group == group]
        train = [e for e in examples if e.group != group]
        progress(f"{k}/{len(groups)}: holding out {group!r} ({len(test)} rows), training on {len(train)}")
        model = fit(train, options).model
        scores[test] = [model.score(examples[i].features) for i in test]
    return scores


def lengths_of(examples: Sequence[Example]) -> FloatArray:
    """Each example's LENGTH_INPUT (the log length of the ask), as the model reads it."""
    value_of = INPUTS[LENGTH_INPUT]
    return np.array([value_of(e.features, read_cues(e.features)) for e in examples], dtype=np.float64)


def boosted(scores: FloatArray, examples: Sequence[Example], boost: float) -> FloatArray:
    """Scores with `boost` added to the logit per standard deviation of the log length of the ask."""
    lengths = lengths_of(examples)
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
    if LENGTH_INPUT not in {n.name for n in model.numeric}:
        raise ValueError(f"the length boost needs the input {LENGTH_INPUT!r}, which this model leaves out")
    lengths = lengths_of(examples)
    mean, std = float(lengths.mean()), float(lengths.std()) or 1.0
    numeric = list(model.numeric)
    intercept = model.intercept
    for i, n in enumerate(numeric):
        if n.name == LENGTH_INPUT:
            # contribution = coef * (x - n.mean) / n.scale; the boost adds boost * (x - mean) / std
            numeric[i] = replace(n, coef=n.coef + boost * n.scale / std)
            intercept += boost * (n.mean - mean) / std
    meta = {**model.meta, "length_boost": boost}
    return Classifier(model.text, model.text_weights, numeric, intercept, meta, model.text_mean)
