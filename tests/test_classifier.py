"""The classifier scorer against scikit-learn, its artifact, explanations, calibration and metric code."""

from __future__ import annotations

import json
import math
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
from sklearn.feature_extraction.text import HashingVectorizer
from sklearn.utils import murmurhash3_32

from gateway.classifier import (
    Calibration,
    CharNgrams,
    Classifier,
    ModelFileError,
    murmurhash3_spans,
    squared_norm,
)
from gateway.classifier_train import (
    Example,
    Fitted,
    apply_length_boost,
    boosted,
    compare_routers,
    design_matrix,
    fit,
    routing_curve,
    summarize,
    tune_length_boost,
)
from gateway.features import Features, extract
from tests.classifier_fixtures import synthetic_rows

TRICKY_TEXTS = [
    "",
    "a",
    "ab",
    "abc",
    "Hello,   World!\n\nTabs\tand\t\tspaces  ",
    "héllo wörld ∫ x² dx 😀 — naïve café",
    "日本語のテキストと English mixed",
    "\ud800 lone surrogate",  # JSON can carry these; sklearn cannot hash them, we must not crash
    "x" * 5000,
]


def request(text: str) -> Features:
    return extract({"messages": [{"role": "user", "content": text}]}, "chat")


def random_text(rng: random.Random) -> str:
    alphabet = "abcdefghij klmnopqrstuvwxyz  \n\tÄéß∫²😀日本0123456789.,?!"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 300)))


@pytest.fixture(scope="module")
def fitted() -> Fitted:
    rows = synthetic_rows(300)
    examples = [
        Example(
            request(r["prompt"]), float(r["q_strong"]), float(r["q_weak"]), r["category"], len(r["prompt"])
        )
        for r in rows
    ]
    return fit(examples, text=CharNgrams(3, 5, 2**14), numeric_weight=3.0)


@pytest.mark.parametrize("length", range(0, 14))
def test_murmur_matches_sklearn_for_every_tail_length(length: int) -> None:
    keys = [bytes(random.Random(length * 100 + i).randrange(256) for _ in range(length)) for i in range(20)]
    data = b"".join(keys)
    starts = np.cumsum([0] + [len(k) for k in keys[:-1]]).astype(np.int64)
    lengths = np.array([len(k) for k in keys], dtype=np.int64)
    ours = murmurhash3_spans(data, starts, lengths).tolist()
    assert ours == [murmurhash3_32(k) for k in keys]


@pytest.mark.parametrize("text", [t for t in TRICKY_TEXTS if "\ud800" not in t])
@pytest.mark.parametrize("sizes", [(3, 5), (1, 9), (5, 5), (2, 4)])
def test_char_ngram_hashes_match_sklearn_analyzer(text: str, sizes: tuple[int, int]) -> None:
    ngrams = CharNgrams(sizes[0], sizes[1], 2**18)
    analyzer = HashingVectorizer(analyzer="char", ngram_range=sizes).build_analyzer()
    expected = [murmurhash3_32(g) for g in analyzer(ngrams.clip(text))]
    assert ngrams.hashes(ngrams.preprocess(text)).tolist() == expected


def test_scores_equal_sklearn_predict_proba(fitted: Fitted) -> None:
    rng = random.Random(7)
    texts = [r["prompt"] for r in synthetic_rows(200, seed=1)] + [random_text(rng) for _ in range(150)]
    texts += [t for t in TRICKY_TEXTS if "\ud800" not in t]
    features = [request(t) for t in texts]
    model = Classifier.from_dict(json.loads(json.dumps(fitted.model.to_dict())))  # through the artifact
    ours = np.array([model.score(f) for f in features])
    theirs = fitted.estimator.predict_proba(design_matrix(fitted.model, features))[:, 1]
    assert np.abs(ours - theirs).max() < 1e-5
    assert ours.std() > 0.05  # the comparison is not between two constants


def test_model_learned_the_synthetic_signal(fitted: Fitted) -> None:
    easy = fitted.model.score(request("what is the capital city of the dog"))
    hard = fitted.model.score(request("prove the theorem: the integral of the eigenvalue derivative matrix"))
    assert hard > easy + 0.2


def test_artifact_round_trip_is_plain_sparse_json(fitted: Fitted, tmp_path: Path) -> None:
    path = tmp_path / "model.json"
    fitted.model.save(path)
    doc = json.loads(path.read_text())
    assert doc["format"] == "agent-gateway/classifier" and doc["version"] == 1
    assert len(doc["text_coef"]["index"]) == len(doc["text_coef"]["value"]) < doc["text"]["n_features"]
    loaded = Classifier.load(path)
    for text in ["prove the lemma", "hello", ""]:
        assert loaded.score(request(text)) == pytest.approx(fitted.model.score(request(text)), abs=1e-6)


def test_pickle_file_is_rejected_without_unpickling(tmp_path: Path) -> None:
    path = tmp_path / "model.json"
    path.write_bytes(pickle.dumps({"format": "agent-gateway/classifier"}))
    with pytest.raises(ModelFileError, match="pickle"):
        Classifier.load(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"format": "something-else", "version": 1}', "format is 'something-else'"),
        ('{"format": "agent-gateway/classifier", "version": 99}', "version 99"),
        ('{"format": "agent-gateway/classifier", "version": 1}', "not a valid classifier artifact"),
        ('{"format": "agent-gateway/classifier", "vers', "not a JSON artifact"),
        ("[1, 2]", "format is 'list'"),
    ],
)
def test_bad_artifacts_name_the_file_and_problem(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ModelFileError, match=message) as info:
        Classifier.load(path)
    assert str(path) in str(info.value)


def test_unknown_numeric_feature_is_rejected(fitted: Fitted) -> None:
    doc = fitted.model.to_dict()
    doc["numeric"][0]["name"] = "moon_phase"
    with pytest.raises(ModelFileError, match="moon_phase"):
        Classifier.from_dict(doc)


def test_explain_contributions_add_up_to_the_logit(fitted: Fitted) -> None:
    features = request("prove the theorem about the integral")
    everything = fitted.model.explain(features, top=10**6)
    assert sum(v for _, v in everything) + fitted.model.intercept == pytest.approx(
        fitted.model.logit(features), abs=1e-2
    )
    top = fitted.model.explain(features, top=5)
    assert len(top) == 5
    assert [abs(v) for _, v in top] == sorted((abs(v) for _, v in top), reverse=True)
    assert any(name.startswith("char:") for name, _ in everything)
    assert any(name == "last_user_tokens" for name, _ in everything)


def test_default_model_ships_and_scores() -> None:
    model = Classifier.default()
    assert model.meta["rows"] == 14037
    scores = [model.score(request(t)) for t in TRICKY_TEXTS]
    assert all(0.0 < s < 1.0 for s in scores)
    assert model.explain(request("Find the derivative of x^3 sin(x)."))


def test_calibration_threshold_for_share(tmp_path: Path) -> None:
    calibration = Calibration.from_scores(np.linspace(0.0, 1.0, 10_001).tolist(), {"rows": 10_001})
    assert calibration.threshold_for_share(0.3) == pytest.approx(0.7, abs=1e-3)
    assert calibration.share_for_threshold(calibration.threshold_for_share(0.25)) == pytest.approx(
        0.25, abs=2e-3
    )
    assert calibration.threshold_for_share(1.0) == 0.0
    assert calibration.share_for_threshold(calibration.threshold_for_share(0.0)) == 0.0
    path = tmp_path / "calibration.json"
    calibration.save(path)
    assert Calibration.load(path).threshold_for_share(0.3) == pytest.approx(0.7, abs=1e-3)
    with pytest.raises(ModelFileError, match="format"):
        Classifier.load(path)  # a calibration file is not a model


def test_default_calibration_matches_the_default_model() -> None:
    calibration = Calibration.default()
    assert 0.0 < calibration.threshold_for_share(0.3) < calibration.threshold_for_share(0.1) < 1.0


def _curve_inputs(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    q_weak = (rng.random(n) < 0.6).astype(float)
    q_strong = np.maximum(q_weak, (rng.random(n) < 0.8).astype(float))
    return q_strong, q_weak


def test_curve_runs_from_fast_only_to_hq_only() -> None:
    q_strong, q_weak = _curve_inputs(1000, 0)
    curve = routing_curve(np.random.default_rng(1).random(1000), q_strong, q_weak)
    assert (curve.hq_share[0], curve.hq_share[-1]) == (0.0, 1.0)
    assert curve.quality[0] == pytest.approx(q_weak.mean()) and curve.quality[-1] == pytest.approx(
        q_strong.mean()
    )
    assert len(curve.hq_share) == 11


def test_apgr_of_oracle_random_and_reversed_routers() -> None:
    q_strong, q_weak = _curve_inputs(5000, 2)
    strong, weak = q_strong.mean(), q_weak.mean()
    gain = q_strong - q_weak + np.random.default_rng(3).random(5000) * 1e-3  # break ties
    oracle = summarize(routing_curve(gain, q_strong, q_weak), strong, weak)
    worst = summarize(routing_curve(-gain, q_strong, q_weak), strong, weak)
    rand = summarize(routing_curve(np.random.default_rng(4).random(5000), q_strong, q_weak), strong, weak)
    assert oracle.apgr > 0.8 and oracle.cpt50 < 0.2
    assert rand.apgr == pytest.approx(0.5, abs=0.05) and rand.cpt50 == pytest.approx(0.5, abs=0.07)
    assert worst.apgr < 0.2 and worst.cpt80 > 0.9
    assert math.isnan(summarize(routing_curve(gain, q_weak, q_weak), weak, weak).apgr)  # no gap to recover


def test_compare_routers_prints_baselines() -> None:
    rows = synthetic_rows(400, seed=5)
    examples = [
        Example(
            request(r["prompt"]), float(r["q_strong"]), float(r["q_weak"]), r["category"], len(r["prompt"])
        )
        for r in rows
    ]
    scores = np.array([e.prompt_chars for e in examples], dtype=float)
    results = compare_routers(scores, examples)
    assert set(results) == {"classifier", "random", "prompt length"}
    assert results["classifier"][0] == results["prompt length"][0]  # same scores, same figures
    assert results["random"][0].apgr == pytest.approx(0.5, abs=0.1)


def test_length_boost_folds_into_the_model_exactly(fitted: Fitted) -> None:
    rows = synthetic_rows(120, seed=9)
    examples = [
        Example(
            request(r["prompt"]), float(r["q_strong"]), float(r["q_weak"]), r["category"], len(r["prompt"])
        )
        for r in rows
    ]
    model = Classifier.from_dict(fitted.model.to_dict())
    before = np.array([model.score(e.features) for e in examples])
    apply_length_boost(model, examples, 0.7)
    after = np.array([model.score(e.features) for e in examples])
    assert np.abs(after - boosted(before, examples, 0.7)).max() < 1e-9
    assert model.meta["length_boost"] == 0.7
    long_first = np.argsort([-e.features.last_user_tokens for e in examples])
    assert (after - before)[long_first[0]] > 0 > (after - before)[long_first[-1]]


def test_tuned_boost_never_lowers_apgr() -> None:
    rows = synthetic_rows(400, seed=11)
    examples = [
        Example(
            request(r["prompt"]), float(r["q_strong"]), float(r["q_weak"]), r["category"], len(r["prompt"])
        )
        for r in rows
    ]
    scores = np.random.default_rng(0).random(len(examples))
    boost, tuned = tune_length_boost(scores, examples)
    plain = compare_routers(scores, examples)["classifier"][0].apgr
    assert compare_routers(tuned, examples)["classifier"][0].apgr >= plain
    assert boost > 0  # on this data longer prompts are the hard ones


@pytest.mark.parametrize(
    ("columns", "negative", "expected"),
    [
        ([5, 5, 7], [False, False, True], 4 + 1),  # repeats add up before squaring
        ([5, 5, 5], [False, True, False], 1),  # opposite signs in one column cancel
        ([3, 9, 3, 9, 9], [True, False, True, True, True], 4 + 1),
        ([1], [False], 1),
    ],
)
def test_squared_norm_groups_columns_and_signs(
    columns: list[int], negative: list[bool], expected: float
) -> None:
    assert squared_norm(np.array(columns, dtype=np.int32), np.array(negative)) == expected


def test_long_text_keeps_head_and_tail() -> None:
    ngrams = CharNgrams(3, 5, 2**18, max_chars=100, tail_chars=30)
    clipped = ngrams.clip("h" * 200 + "QUESTION" + "t" * 22)
    assert len(clipped) == 100 and clipped.startswith("h" * 70) and clipped.endswith("QUESTION" + "t" * 22)


def test_crowded_columns_still_equal_sklearn() -> None:
    """16 columns: n-grams of both signs share columns, on the short-text and the numpy paths alike."""
    rows = synthetic_rows(120, seed=3)
    examples = [
        Example(
            request(r["prompt"]), float(r["q_strong"]), float(r["q_weak"]), r["category"], len(r["prompt"])
        )
        for r in rows
    ]
    crowded = fit(examples, text=CharNgrams(3, 5, 16))
    rng = random.Random(5)
    features = [request(random_text(rng)) for _ in range(60)] + [e.features for e in examples[:20]]
    ours = np.array([crowded.model.score(f) for f in features])
    theirs = crowded.estimator.predict_proba(design_matrix(crowded.model, features))[:, 1]
    assert np.abs(ours - theirs).max() < 1e-9
