"""Soft labels, leave-one-benchmark-out scores and the per-dataset / mixed-stream figures."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.classifier import training
from gateway.classifier.evaluation import ALL_ROWS, MIXED, by_dataset, dataset_report, mixed_stream
from gateway.classifier.options import TrainingOptions
from gateway.classifier.scoring import Classifier
from gateway.classifier.training import Example, fit, hold_out_each, targets
from gateway.features import extract
from tests.fixtures.classifier_data import synthetic_rows


def example(text: str = "hi", q_strong: float = 1.0, q_weak: float = 0.0, **extra: object) -> Example:
    features = extract({"messages": [{"role": "user", "content": text}]}, "chat")
    return Example(features, q_strong, q_weak, prompt_chars=len(text), **extra)  # type: ignore[arg-type]


def examples_in(datasets: dict[str, int], seed: int = 0) -> list[Example]:
    """Synthetic rows split into datasets of the given sizes; each dataset is its own benchmark."""
    rows = synthetic_rows(sum(datasets.values()), seed=seed)
    names = [name for name, size in datasets.items() for _ in range(size)]
    return [
        example(r["prompt"], float(r["q_strong"]), float(r["q_weak"]), dataset=name, group=name)
        for r, name in zip(rows, names, strict=True)
    ]


def test_fast_fails_target_reads_the_fast_answer_or_the_pool_fail_share() -> None:
    rows = [example(q_strong=1, q_weak=0), example(q_strong=0, q_weak=1), example(q_strong=1, q_weak=1),
            example(q_strong=1, q_weak=0, fail_share=0.25)]
    pos, neg = targets(rows, TrainingOptions(target="fast-fails"))
    assert pos.tolist() == [1.0, 0.0, 0.0, 0.25]
    assert neg.tolist() == [0.0, 1.0, 1.0, 0.75]


def test_gap_target_weighs_rows_where_fast_answered_better() -> None:
    rows = [example(q_strong=1, q_weak=0), example(q_strong=0, q_weak=1), example(q_strong=1, q_weak=1),
            example(q_strong=0.8, q_weak=0.3), example(fail_share=0.4)]
    pos, neg = targets(rows, TrainingOptions(target="gap", fast_wins_weight=3.0))
    assert pos.tolist() == pytest.approx([1.0, 0.0, 0.0, 0.5, 0.4])
    assert neg.tolist() == pytest.approx([0.0, 3.0, 1.0, 0.5, 0.6])


def test_soft_labels_fit_like_the_same_rows_split_by_outcome() -> None:
    """A row with label 0.25 weighs as a positive with 0.25 and a negative with 0.75 (one model either way)."""
    rows = examples_in({"a": 120})
    soft = [Example(e.features, e.q_strong, e.q_weak, fail_share=0.25 if i % 2 else 1.0 - e.q_weak)
            for i, e in enumerate(rows)]
    model = fit(soft, TrainingOptions(min_df=1)).model
    assert 0.0 < model.score(rows[0].features) < 1.0
    with pytest.raises(ValueError, match="both outcomes"):
        fit([example(q_weak=1.0), example(q_weak=1.0)])


def test_each_benchmark_is_scored_by_a_model_that_never_saw_it(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = examples_in({"a": 60, "b": 60, "c": 60})
    seen: list[set[str]] = []
    real_fit = training.fit

    def recording_fit(train: list[Example], options: TrainingOptions) -> training.Fitted:
        seen.append({e.group for e in train})
        return real_fit(train, options)

    monkeypatch.setattr(training, "fit", recording_fit)
    scores = hold_out_each(rows, options=TrainingOptions(min_df=1))
    assert seen == [{"b", "c"}, {"a", "c"}, {"a", "b"}]
    assert scores.shape == (180,) and ((scores > 0) & (scores < 1)).all()


def test_mixed_stream_takes_at_most_n_rows_of_each_dataset() -> None:
    rows = examples_in({"big": 300, "small": 40})
    chosen = mixed_stream(rows, per_dataset=100)
    datasets = [rows[i].dataset for i in chosen]
    assert datasets.count("big") == 100 and datasets.count("small") == 40
    assert chosen == mixed_stream(rows, per_dataset=100)  # the same stream every run


def test_dataset_table_has_each_dataset_the_mixed_stream_and_all_rows() -> None:
    rows = examples_in({"a": 150, "b": 150})
    lengths = np.array([e.prompt_chars for e in rows], dtype=float)
    tables = by_dataset(lengths, rows)
    assert list(tables) == ["a", "b", MIXED, ALL_ROWS]
    assert tables[ALL_ROWS][0] == 300
    lines = dataset_report(tables)
    assert lines[0].split()[:3] == ["held-out", "dataset", "rows"]
    # the classifier here is prompt length itself: it clears the bar exactly where length beats random + 0.03
    for line in lines[1:]:
        apgr, rand, length = map(float, line.split()[-6:-3])
        assert apgr == length
        assert line.endswith("yes") == (apgr >= rand + 0.03)


def test_a_model_without_cue_inputs_never_reads_the_cues() -> None:
    rows = examples_in({"a": 120})
    model = fit(rows, TrainingOptions(min_df=1, numeric=("last_user_tokens", "has_math"))).model
    assert not model.reads_cues
    assert Classifier.from_dict(fit(rows, TrainingOptions(min_df=1)).model.to_dict()).reads_cues
