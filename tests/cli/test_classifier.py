"""`classifier train|score|eval|calibrate` on small CSV files, including the bad ones."""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.classifier.scoring import Calibration, Classifier
from gateway.cli import classifier as classifier_cli
from gateway.features import extract
from tests.fixtures.classifier_data import as_messages, synthetic_rows, write_csv

SMALL = ("--min-df", "1")  # tiny data: every n-gram it has enters the vocabulary


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="agent-gateway")
    classifier_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    code: int = args.func(args)
    return code


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("classifier_cli")


@pytest.fixture(scope="module")
def data(workdir: Path) -> Path:
    return write_csv(workdir / "train.csv.gz", synthetic_rows(240))


@pytest.fixture(scope="module")
def model(workdir: Path, data: Path) -> Path:
    out = workdir / "model.json"
    assert run("classifier", "train", "--data", str(data), "--out", str(out), *SMALL) == 0
    return out


def test_train_with_grouped_cv_prints_figures_and_records_them(
    workdir: Path, data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = workdir / "cv-model.json"
    code = run(
        "classifier",
        "train",
        "--data",
        str(data),
        "--out",
        str(out),
        "--group-by",
        "category",
        "--cv",
        "3",
        *SMALL,
    )
    printed = capsys.readouterr()
    assert code == 0
    assert "fold 3/3" in printed.err  # progress goes to stderr
    for router in ("classifier", "random", "prompt length"):
        assert router in printed.out
    meta = json.loads(out.read_text())["meta"]
    assert meta["cv"]["plain"]["classifier"]["apgr"] > meta["cv"]["plain"]["random"]["apgr"]
    assert meta["rows"] == 240 and meta["group_by"] == "category"
    assert "length_boost" not in meta["cv"]  # only with --tune-length-boost


def test_train_can_tune_the_length_boost(
    workdir: Path, data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = workdir / "boosted-model.json"
    argv = ["--group-by", "category", "--cv", "2", "--tune-length-boost", *SMALL]
    assert run("classifier", "train", "--data", str(data), "--out", str(out), *argv) == 0
    assert "length boost" in capsys.readouterr().out
    meta = json.loads(out.read_text())["meta"]
    assert meta["cv"]["length_boost"]["classifier"]["apgr"] >= meta["cv"]["plain"]["classifier"]["apgr"]


def test_score_appends_a_score_column(workdir: Path, data: Path, model: Path) -> None:
    out = workdir / "scored.csv"
    assert run("classifier", "score", "--data", str(data), "--out", str(out), "--model", str(model)) == 0
    with out.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    with gzip.open(data, "rt", newline="") as handle:
        original = list(csv.DictReader(handle))
    assert len(rows) == len(original)
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in original]  # multi-line prompts survive
    assert list(rows[0]) == [*original[0], "score"]
    scores = [float(r["score"]) for r in rows]
    assert all(0.0 <= s <= 1.0 for s in scores) and len(set(scores)) > 10
    hard = [s for r, s in zip(original, scores, strict=True) if r["q_weak"] == "0.0"]
    easy = [s for r, s in zip(original, scores, strict=True) if r["q_weak"] == "1.0"]
    assert sum(hard) / len(hard) > sum(easy) / len(easy)


def test_score_reads_a_messages_column(workdir: Path, model: Path) -> None:
    data = write_csv(workdir / "messages.csv", as_messages(synthetic_rows(20)))
    out = workdir / "messages-scored.csv.gz"
    assert run("classifier", "score", "--data", str(data), "--out", str(out), "--model", str(model)) == 0
    with gzip.open(out, "rt", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 20 and "messages" in rows[0] and "score" in rows[0]


def test_eval_with_a_model_writes_a_plot(
    workdir: Path, data: Path, model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = workdir / "curve.png"
    assert run("classifier", "eval", "--data", str(data), "--model", str(model), "--plot", str(png)) == 0
    out = capsys.readouterr().out
    assert "APGR" in out and "CPT(50%)" in out and "prompt length" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_cross_validates_by_group(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("classifier", "eval", "--data", str(data), "--cv", "2", "--group-by", "category", *SMALL) == 0
    lines = capsys.readouterr().out.splitlines()
    classifier_line = next(line for line in lines if line.startswith("classifier"))
    assert float(classifier_line.split()[1]) > 0.55  # APGR well above random on this easy data


def test_calibrate_prints_and_writes_the_threshold(
    workdir: Path, data: Path, model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = workdir / "calibration.json"
    code = run(
        "classifier",
        "calibrate",
        "--data",
        str(data),
        "--target-hq-share",
        "0.3",
        "--model",
        str(model),
        "--out",
        str(out),
    )
    assert code == 0
    printed = capsys.readouterr().out
    threshold = float(printed.split()[1])
    assert "to HQ" in printed
    assert Calibration.load(out).threshold_for_share(0.3) == pytest.approx(threshold, abs=1e-4)
    scores = [
        Classifier.load(model).score(classifier_cli._features(r.body))
        for r in classifier_cli.read_rows(str(data), labelled=False)
    ]
    assert sum(s >= threshold for s in scores) / len(scores) == pytest.approx(0.3, abs=0.02)


def _bad(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("content", "fragments"),
    [
        ("prompt,q_strong,q_weak\nhello,1,0\nbye,high,0\n", ["row 2", "'q_strong'", "'high'"]),
        ("prompt,q_strong\nhello,1\n", ["missing column", "q_weak"]),
        ('messages,q_strong,q_weak\n"[{""role"": ",1,0\n', ["row 1", "'messages'", "not JSON"]),
        ('messages,q_strong,q_weak\n"{""a"": 1}",1,0\n', ["row 1", "expected a JSON array"]),
        ("prompt,q_strong,q_weak\n", ["no data rows"]),
        ("prompt,q_strong,q_weak\nhello,1,nan\n", ["row 1", "'q_weak'", "'nan'"]),
    ],
)
def test_bad_csv_exits_2_with_one_clear_line(
    tmp_path: Path, content: str, fragments: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    path = _bad(tmp_path, content)
    assert run("classifier", "eval", "--data", str(path), "--cv", "2") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert str(path) in err
    for fragment in fragments:
        assert fragment in err


def test_missing_file_and_pickled_model_exit_2(
    tmp_path: Path, data: Path, model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = str(tmp_path / "nope.csv")
    assert (
        run("classifier", "score", "--data", missing, "--out", str(tmp_path / "o.csv"), "--model", str(model))
        == 2
    )
    assert "nope.csv" in capsys.readouterr().err
    pickled = tmp_path / "model.json"
    pickled.write_bytes(pickle.dumps(object))
    code = run(
        "classifier", "score", "--data", str(data), "--out", str(tmp_path / "o.csv"), "--model", str(pickled)
    )
    assert code == 2
    assert "pickle" in capsys.readouterr().err


def test_group_by_column_must_exist(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("classifier", "eval", "--data", str(data), "--cv", "2", "--group-by", "subject") == 2
    assert "'subject'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "fragment"), [(("--min-df", "0"), "--min-df"), (("--ngram", "5", "3"), "--ngram")]
)
def test_bad_text_options_exit_2(
    data: Path, option: tuple[str, ...], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run("classifier", "eval", "--data", str(data), "--cv", "2", *option) == 2
    assert fragment in capsys.readouterr().err


def test_ngram_sizes_reach_the_model(workdir: Path, data: Path) -> None:
    out = workdir / "trigram-model.json"
    assert run("classifier", "train", "--data", str(data), "--out", str(out), "--ngram", "3", "3", *SMALL) == 0
    model = Classifier.load(out)
    assert (model.text.ngram_min, model.text.ngram_max) == (3, 3)
    assert all(len(gram) == 3 for gram in model.text_weights)


def test_target_share_out_of_range(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("classifier", "calibrate", "--data", str(data), "--target-hq-share", "1.5") == 2
    assert "--target-hq-share" in capsys.readouterr().err


def test_building_the_cli_does_not_load_scikit_learn() -> None:
    """`serve` builds the same parser as the classifier commands; the training stack stays unloaded."""
    code = ("import sys, gateway.cli.command as c; c.build_parser(); "
            "print(sorted(m for m in ('sklearn', 'scipy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def _label(i: int, verdict: str, body: dict[str, object] | None) -> dict[str, object]:
    q = {"weak_worse": (1.0, 0.0), "tie": (1.0, 1.0), "weak_better": (0.0, 1.0)}[verdict]
    row: dict[str, object] = {"request_id": f"r{i}", "endpoint": "chat", "verdict": verdict,
                              "q_strong": q[0], "q_weak": q[1], "features": {"prompt_tokens": 9}}
    if body is not None:
        row["body"] = body
    return row


def _ask(text: str) -> dict[str, object]:
    return {"model": "auto", "messages": [{"role": "user", "content": text}]}


def test_train_mixes_labels_by_weight_skipping_rows_without_prompt(
    workdir: Path, data: Path, model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [_label(i, "weak_worse", _ask(f"What is {i + 11} + {i * 7 % 50 + 10}?")) for i in range(30)]
    rows += [_label(100 + i, "tie", _ask(f"tell me about the {w}")) for i, w in enumerate(["dog", "song", "city"] * 10)]
    rows += [_label(200 + i, "weak_worse", None) for i in range(4)]  # labelled without the prompts opt-in
    labels = workdir / "labels.jsonl"
    labels.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = workdir / "learned.json"
    argv = ["--data", str(data), "--labels", str(labels), "--labels-weight", "3", "--out", str(out), *SMALL]
    assert run("classifier", "train", *argv) == 0
    assert "60 label rows used, skipped: 4 no prompt text" in capsys.readouterr().err
    meta = json.loads(out.read_text())["meta"]
    assert (meta["label_rows"], meta["labels_weight"], meta["label_rows_skipped"]) == (60, 3.0, {"no prompt text": 4})
    assert meta["rows"] == 240 + 60
    held_out = extract(_ask("What is 64 + 29?"), "chat")
    before, after = Classifier.load(model), Classifier.load(out)
    assert after.score(held_out) > before.score(held_out) + 0.2


def test_labels_without_prompts_take_them_from_a_request_log(
    tmp_path: Path, data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    labels, log = tmp_path / "labels.jsonl", tmp_path / "requests.jsonl"
    labels.write_text("".join(json.dumps(_label(i, "weak_worse" if i % 2 else "tie", None)) + "\n" for i in range(6)))
    logged = [{"request_id": f"r{i}", "endpoint": "chat", "body": _ask(f"a question, number {i}")} for i in range(4)]
    log.write_text("".join(json.dumps(r) + "\n" for r in logged))
    argv = ["--labels", str(labels), "--request-log", str(log), "--out", str(tmp_path / "m.json"), *SMALL]
    assert run("classifier", "train", *argv) == 0
    assert "4 label rows used, skipped: 2 no prompt text" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "fragment"),
    [("{not json\n", "labels.jsonl:1: not a JSON object"),
     ('{"q_strong": 1, "q_weak": "x", "body": {}}\n', "labels.jsonl:1: field 'q_weak': value 'x' is not a number"),
     ('{"q_strong": 1, "q_weak": 0}\n', "no label row has prompt text")],
)
def test_bad_labels_exit_2_naming_file_line_and_field(
    tmp_path: Path, content: str, fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    labels = tmp_path / "labels.jsonl"
    labels.write_text(content)
    assert run("classifier", "train", "--labels", str(labels), "--out", str(tmp_path / "m.json")) == 2
    assert fragment in capsys.readouterr().err


def test_train_needs_data_or_labels(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("classifier", "train", "--out", str(tmp_path / "m.json")) == 2
    assert "give --data CSV or --sets MANIFEST, --labels JSONL, or both" in capsys.readouterr().err


def _manifest(folder: Path, body: str) -> Path:
    path = folder / "sets.yaml"
    path.write_text(f"data_dir: {folder}\n{body}")
    return path


SETS = """sets:
  - file: pairs.csv.gz
    name: pairs
    split_by: category
    datasets: {algebra: [algebra, math], trivia: [trivia, trivia], physics: [physics, science], chat: [chat, chat]}
  - file: pool.csv
    name: pool
    label: fail-share
    pair: ["score:big", "score:small"]
    dataset: everything
    benchmark: science
"""


@pytest.fixture(scope="module")
def sets(workdir: Path) -> Path:
    folder = workdir / "sets"
    folder.mkdir()
    write_csv(folder / "pairs.csv.gz", synthetic_rows(160, seed=3))
    pool = [
        {"prompt": r["prompt"], "score:big": r["q_strong"], "score:small": r["q_weak"], "score:mid": "0.5"}
        for r in synthetic_rows(80, seed=4)
    ]
    write_csv(folder / "pool.csv", pool)
    return _manifest(folder, SETS)


def test_eval_leaves_each_benchmark_out_and_reports_datasets_and_a_mixed_stream(
    sets: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run("classifier", "eval", "--sets", str(sets), "--leave-one-out", *SMALL) == 0
    printed = capsys.readouterr()
    assert "holding out 'science'" in printed.err  # physics (pairs) and everything (pool) go together
    names = [line.split()[0] for line in printed.out.splitlines()[1:]]
    assert names == ["pairs/algebra", "pairs/chat", "pairs/physics", "pairs/trivia", "pool/everything", "mixed", "all"]
    assert "random" in printed.out and "length" in printed.out and "CPT(80%)" in printed.out


def test_train_on_sets_records_the_held_out_figures(workdir: Path, sets: Path) -> None:
    out = workdir / "sets-model.json"
    assert run("classifier", "train", "--sets", str(sets), "--leave-one-out", "--out", str(out), *SMALL) == 0
    meta = json.loads(out.read_text())["meta"]
    assert meta["datasets"]["pool/everything"] == 80 and meta["rows"] == 240 and meta["target"] == "fast-fails"
    assert set(meta["cv"]["leave_one_out"]["mixed stream"]) == {"classifier", "random", "prompt length"}
    assert Classifier.load(out).reads_cues


def test_calibrate_on_the_mixed_stream_of_sets(workdir: Path, sets: Path, model: Path) -> None:
    out = workdir / "sets-calibration.json"
    argv = ["--sets", str(sets), "--target-hq-share", "0.2", "--model", str(model), "--out", str(out)]
    assert run("classifier", "calibrate", *argv) == 0
    assert Calibration.load(out).meta == {"data": "sets.yaml", "rows": 240}


@pytest.mark.parametrize(
    ("body", "fragments"),
    [
        (SETS.replace("split_by: category", "split_by: category\n    colour: red"), ["sets.0.colour", "xtra"]),
        (SETS.replace("trivia: [trivia, trivia], ", ""), ["pairs.csv.gz", "row", "'category'", "'trivia'"]),
        (SETS.replace("    dataset: everything\n", ""), ["sets.1", "`dataset` and `benchmark`"]),
        (SETS.replace("label: fail-share", "label: vibes"), ["sets.1.label", "vibes"]),
        ("sets: [", ["not YAML"]),
    ],
)
def test_bad_manifest_exits_2_naming_file_and_field(
    sets: Path, tmp_path: Path, body: str, fragments: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("pairs.csv.gz", "pool.csv"):
        (tmp_path / name).write_bytes((sets.parent / name).read_bytes())
    manifest = _manifest(tmp_path, body)
    assert run("classifier", "eval", "--sets", str(manifest), "--leave-one-out", *SMALL) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    for fragment in fragments:
        assert fragment in err


def test_leave_one_out_needs_something_to_hold_out(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("classifier", "eval", "--data", str(data), "--leave-one-out") == 2
    assert "--group-by" in capsys.readouterr().err


def test_default_sets_manifest_is_valid() -> None:
    from gateway.cli.classifier_data import DEFAULT_SETS_PATH, read_manifest

    manifest = read_manifest(DEFAULT_SETS_PATH)
    assert [s.file for s in manifest.sets] == [
        "mmlu_gpt4_vs_mixtral.csv.gz",
        "routerbench_train.csv.gz",
        "small7_train.csv.gz",
    ]
