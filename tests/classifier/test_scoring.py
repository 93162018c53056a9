"""The classifier scorer against scikit-learn, its artifact, explanations, calibration and metric code."""

from __future__ import annotations

import json
import math
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
from sklearn.feature_extraction.text import CountVectorizer

from gateway.classifier.evaluation import compare_routers, routing_curve, summarize
from gateway.classifier.ngrams import NgramWeights
from gateway.classifier.options import TrainingOptions
from gateway.classifier.scoring import Calibration, Classifier, ModelFileError
from gateway.classifier.training import (
    Example,
    Fitted,
    boosted,
    design_matrix,
    fit,
    tune_length_boost,
    with_length_boost,
)
from gateway.classifier.vocabulary import SHORT_TEXT_CHARS, CharNgrams
from gateway.features import Features, extract
from tests.fixtures.classifier_data import synthetic_rows

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


def examples_of(rows: list[dict[str, str]]) -> list[Example]:
    return [
        Example(request(r["prompt"]), float(r["q_strong"]), float(r["q_weak"]), r["category"], len(r["prompt"]))
        for r in rows
    ]


@pytest.fixture(scope="module")
def fitted() -> Fitted:
    return fit(examples_of(synthetic_rows(300)), TrainingOptions(numeric_weight=3.0, min_df=1))


@pytest.mark.parametrize("text", [t for t in TRICKY_TEXTS if "\ud800" not in t])
@pytest.mark.parametrize("sizes", [(4, 4), (3, 4), (1, 4), (2, 3)])
def test_char_ngrams_match_sklearn_analyzer(text: str, sizes: tuple[int, int]) -> None:
    ngrams = CharNgrams(*sizes)
    analyzer = CountVectorizer(analyzer="char", ngram_range=sizes).build_analyzer()
    assert list(ngrams.ngrams(ngrams.preprocess(text))) == analyzer(ngrams.clip(text))


def test_scores_equal_sklearn_predict_proba(fitted: Fitted) -> None:
    rng = random.Random(7)
    texts = [r["prompt"] for r in synthetic_rows(200, seed=1)] + [random_text(rng) for _ in range(150)]
    texts += [t for t in TRICKY_TEXTS if "\ud800" not in t]
    texts += [" ".join(texts[i : i + 12]) for i in range(0, 240, 12)]  # long texts, beyond the n-gram cutter's cache
    features = [request(t) for t in texts]
    model = Classifier.from_dict(json.loads(json.dumps(fitted.model.to_dict())))  # through the artifact
    ours = np.array([model.score(f) for f in features])
    theirs = fitted.estimator.predict_proba(design_matrix(fitted.model, features))[:, 1]
    assert np.abs(ours - theirs).max() < 1e-5
    assert ours.std() > 0.05  # the comparison is not between two constants
    assert sum(len(model.text.preprocess(t)) > SHORT_TEXT_CHARS for t in texts) >= 20


def test_repeats_add_up_and_unknown_ngrams_count_for_nothing() -> None:
    block = NgramWeights(CharNgrams(4, 4), {"abab": 1.0, "baba": 0.5, "zzzz": 9.0})
    # abab twice, baba once: (2 * 1.0 + 0.5) / sqrt(2**2 + 1**2); "bab!", "ab!?" are not in the vocabulary
    assert block.logit("ababab!?") == pytest.approx(2.5 / math.sqrt(5))
    assert block.logit("ABABAB") == pytest.approx(2.5 / math.sqrt(5))  # lowercased, as sklearn does
    assert block.logit("nothing known here") == 0.0
    long_text = "ababab!?" + " " * 2 + "x" * (SHORT_TEXT_CHARS + 10)  # a long text, same figure
    assert block.logit(long_text) == pytest.approx(2.5 / math.sqrt(5))


def test_inputs_constant_in_training_get_no_weight(fitted: Fitted) -> None:
    weights = {n.name: n.coef for n in fitted.model.numeric}
    assert weights["message_count"] == weights["history_tokens"] == weights["tools_count"] == 0.0  # one turn
    assert weights["ask_chars"] != 0.0


def test_model_learned_the_synthetic_signal(fitted: Fitted) -> None:
    # shaped like the training prompts, which end with "?" or "Answer:"
    easy = fitted.model.score(request("what is the capital city of the dog?"))
    hard = fitted.model.score(request("prove the theorem: the integral of the eigenvalue derivative matrix?"))
    assert hard > easy + 0.2


def test_artifact_round_trip_is_plain_sparse_json(fitted: Fitted, tmp_path: Path) -> None:
    path = tmp_path / "model.json"
    fitted.model.save(path)
    doc = json.loads(path.read_text())
    assert doc["format"] == "agent-gateway/classifier" and doc["version"] == 2
    assert list(doc["text_weights"]) == list(fitted.model.text_weights)  # the column order survives
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
        ('{"format": "agent-gateway/classifier", "version": 1}', "version 1 is not 2; retrain"),  # hashed n-grams
        ('{"format": "agent-gateway/classifier", "version": 2}', "not a valid classifier artifact"),
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
    assert any(name == "ask_chars" for name, _ in everything)


def test_default_model_ships_and_scores() -> None:
    model = Classifier.default()
    assert model.meta["rows"] == 24980 and model.meta["target"] == "fast-fails"  # default.sets.yaml, every row
    assert model.reads_cues
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
    examples = examples_of(synthetic_rows(300))[:120]  # rows it was fitted on: inputs within their range
    model = Classifier.from_dict(fitted.model.to_dict())
    before = np.array([model.score(e.features) for e in examples])
    boosted_model = with_length_boost(model, examples, 0.7)
    after = np.array([boosted_model.score(e.features) for e in examples])
    assert np.abs(after - boosted(before, examples, 0.7)).max() < 1e-9
    assert boosted_model.meta["length_boost"] == 0.7 and "length_boost" not in model.meta
    long_first = np.argsort([-len(e.features.last_user_text) for e in examples])
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


def test_inputs_outside_the_training_range_read_as_its_ends(fitted: Fitted) -> None:
    model = Classifier.from_dict(json.loads(json.dumps(fitted.model.to_dict())))
    ask = next(n for n in model.numeric if n.name == "ask_chars")
    assert math.isfinite(ask.low) and ask.low < ask.high
    tiny, huge = request("?"), request("integral " * 5000)
    cues = model.cues(tiny), model.cues(huge)
    assert ask.value(tiny, cues[0]) == ask.low and ask.value(huge, cues[1]) == ask.high
    doc = fitted.model.to_dict()
    for entry in doc["numeric"]:  # an artifact from before ranges were kept reads every value as it is
        entry.pop("low", None), entry.pop("high", None)
    unbounded = Classifier.from_dict(doc)
    assert all(n.low == -math.inf and n.high == math.inf for n in unbounded.numeric)
    assert unbounded.score(huge) != model.score(huge)  # a linear model extrapolates without the clip


def test_a_text_without_known_ngrams_reads_as_the_average_text(fitted: Fitted) -> None:
    model = Classifier.from_dict(json.loads(json.dumps(fitted.model.to_dict())))
    assert model.text_mean != 0.0 and model.text_mean == fitted.model.text_mean
    assert model.text_logit("hi") == model.text_mean  # no 4-gram at all
    assert model.text_logit("zzzzqqqq") == model.text_mean  # 4-grams, none in the vocabulary
    assert model.text_logit("prove the theorem") != model.text_mean
    names = [name for name, _ in model.explain(request("hi"), top=100)]
    assert "text: no known n-gram, read as the average" in names


def test_a_model_loaded_from_its_file_keeps_no_weights_and_reads_them_back_to_explain(tmp_path: Path) -> None:
    from gateway.classifier import ngrams
    from gateway.classifier.scoring import DEFAULT_MODEL_PATH
    path = tmp_path / "model.json"
    path.write_bytes(Path(DEFAULT_MODEL_PATH).read_bytes())
    loaded, kept = Classifier.load(path), Classifier.from_dict(json.loads(path.read_text()))
    assert (loaded.text_block._kept is None) == (ngrams.native is not None)  # the C table scores, nothing kept
    asked = request("refactor the tokenizer and prove the invariant of its merge loop")
    assert loaded.score(asked) == kept.score(asked)
    assert loaded.explain(asked) == kept.explain(asked)
    assert loaded.text_weights == kept.text_weights
    if ngrams.native is not None:
        path.write_text(path.read_text() + "\n")  # another artifact under the same name
        with pytest.raises(ModelFileError, match="changed since the gateway loaded it"):
            loaded.explain(asked)
