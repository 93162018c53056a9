"""The `classifier` command: train, score, eval and calibrate from CSV files of labelled prompts."""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from gateway.classifier.options import DEFAULT_OPTIONS, TrainingOptions
from gateway.classifier.scoring import Calibration, Classifier, ModelFileError
from gateway.features import Features, extract

if TYPE_CHECKING:
    from types import ModuleType

    from gateway.classifier.training import Example

PROGRESS_EVERY_ROWS = 2_000


class DataError(ValueError):
    """Bad input data; the message names the file, row, column and value."""


@dataclass(frozen=True, slots=True)
class Row:
    """One CSV row: the original cells and the request they describe."""

    cells: dict[str, str]
    body: dict[str, Any]
    prompt_chars: int
    q_strong: float = float("nan")
    q_weak: float = float("nan")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `classifier train|score|eval|calibrate` to the top-level parser."""
    parser = subparsers.add_parser(
        "classifier", help="train, score, evaluate and calibrate the complexity classifier"
    )
    commands = parser.add_subparsers(dest="classifier_command", required=True)

    train = commands.add_parser("train", help="fit a model on CSV rows (prompt|messages, q_strong, q_weak)")
    train.add_argument("--data", help="CSV or CSV.gz file (needed unless --labels is given)")
    train.add_argument("--labels", help="JSONL of shadow-pair labels (`agent-gateway shadow labels`), beside --data")
    train.add_argument("--labels-weight", type=float, default=1.0,
                       help="each label row weighs this many CSV rows in the fit (default: %(default)s)")
    train.add_argument("--request-log", help="request log JSONL kept with prompts: gives labels without one "
                       "their prompt (by request id)")
    train.add_argument("--out", required=True, help="where to write the JSON model")
    train.add_argument("--group-by", help="column to group by for the cross-validation run before fitting")
    train.add_argument("--cv", type=int, default=5, help="folds for that run (with --group-by; 0 skips it)")
    train.add_argument(
        "--tune-length-boost",
        action="store_true",
        help="after the cross-validation, tune one extra weight on prompt length for ranking (APGR)",
    )
    train.add_argument("--plot", help="write the cross-validation curve to this PNG")
    _add_training_arguments(train)
    train.set_defaults(func=run_train)

    score = commands.add_parser("score", help="append a score column (higher: HQ more needed)")
    score.add_argument("--data", required=True)
    score.add_argument("--out", required=True, help="CSV to write (gzip if it ends in .gz)")
    score.add_argument("--model", help="JSON model (default: the packaged one)")
    score.set_defaults(func=run_score)

    evaluate = commands.add_parser("eval", help="RouteLLM figures: APGR, CPT(50%%), CPT(80%%) vs baselines")
    evaluate.add_argument("--data", required=True)
    evaluate.add_argument("--model", help="JSON model to evaluate (default: the packaged one)")
    evaluate.add_argument("--cv", type=int, help="cross-validate K folds instead of using a model")
    evaluate.add_argument("--group-by", help="column whose values are held out together in --cv")
    _add_training_arguments(evaluate)
    evaluate.add_argument("--plot", help="write the quality-vs-HQ-share curve to this PNG")
    evaluate.set_defaults(func=run_eval)

    calibrate = commands.add_parser("calibrate", help="threshold that sends a target share of traffic to HQ")
    calibrate.add_argument("--data", required=True, help="CSV of representative traffic (prompt|messages)")
    calibrate.add_argument("--target-hq-share", type=float, required=True, help="e.g. 0.3 for 30%%")
    calibrate.add_argument("--model", help="JSON model (default: the packaged one)")
    calibrate.add_argument("--out", help="also write a calibration JSON file for policies")
    calibrate.set_defaults(func=run_calibrate)


def _add_training_arguments(parser: argparse.ArgumentParser) -> None:
    default = DEFAULT_OPTIONS
    parser.add_argument("--c", type=float, default=default.c, help="inverse L2 regularization strength")
    parser.add_argument(
        "--ngram",
        type=int,
        nargs=2,
        metavar=("MIN", "MAX"),
        default=(default.text.ngram_min, default.text.ngram_max),
        help="character n-gram sizes (default: %(default)s)",
    )
    parser.add_argument(
        "--min-df",
        type=int,
        default=default.min_df,
        help="prompts an n-gram must appear in to enter the vocabulary (default: %(default)s)",
    )
    parser.add_argument(
        "--numeric-weight",
        type=float,
        default=default.numeric_weight,
        help="weaker L2 penalty on the structured inputs (prompt length, tools...) by this factor",
    )
    parser.add_argument(
        "--fast-wins-weight",
        type=float,
        default=default.fast_wins_weight,
        help="weight of rows where the fast deployment answered better (default: %(default)s)",
    )


def _training(args: argparse.Namespace) -> TrainingOptions:
    """The training options chosen on the command line."""
    if args.min_df < 1:
        raise DataError(f"--min-df must be at least 1, got {args.min_df}")
    if args.fast_wins_weight < 0:
        raise DataError(f"--fast-wins-weight must be at least 0, got {args.fast_wins_weight}")
    try:
        text = replace(DEFAULT_OPTIONS.text, ngram_min=args.ngram[0], ngram_max=args.ngram[1])
    except ValueError as exc:
        raise DataError(f"--ngram: {exc}") from exc
    return replace(
        DEFAULT_OPTIONS,
        text=text,
        min_df=args.min_df,
        c=args.c,
        numeric_weight=args.numeric_weight,
        fast_wins_weight=args.fast_wins_weight,
    )


def _guarded(run: Any) -> Any:
    """Turn bad input into one clear line on stderr and exit code 2, never a traceback."""

    def wrapper(args: argparse.Namespace) -> int:
        try:
            code: int = run(args)
            return code
        except (DataError, ModelFileError, ValueError) as exc:
            print(f"classifier {args.classifier_command}: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"classifier {args.classifier_command}: {exc.filename}: {exc.strerror}", file=sys.stderr)
            return 2

    return wrapper


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def open_text(path: str, mode: str = "r") -> IO[str]:
    """A text handle on a plain or gzip file (by suffix)."""
    if path.endswith(".gz"):
        if mode == "w":
            return gzip.open(path, "wt", encoding="utf-8", newline="")
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return open(path, mode, encoding="utf-8", newline="")


def read_rows(path: str, *, labelled: bool) -> Iterator[Row]:
    """Rows of a prompt CSV; raises DataError naming file, row, column and value on bad input."""
    csv.field_size_limit(2**31 - 1)  # prompts can be far longer than csv's 128 KiB default
    with open_text(path) as handle:
        reader = csv.DictReader(handle)
        columns = reader.fieldnames or []
        text_column = "messages" if "messages" in columns else "prompt"
        needed = [text_column] + (["q_strong", "q_weak"] if labelled else [])
        missing = [c for c in needed if c not in columns]
        if missing:
            raise DataError(f"{path}: missing column(s) {missing}; found {columns}")
        try:
            for number, cells in enumerate(reader, start=1):
                yield _row(path, number, cells, text_column, labelled)
        except csv.Error as exc:
            raise DataError(f"{path}: row {reader.line_num}: malformed CSV: {exc}") from exc


def _row(path: str, line: int, cells: dict[str, str], text_column: str, labelled: bool) -> Row:
    """One data row (numbered from 1 after the header) as a chat request."""
    raw = cells.get(text_column)
    if raw is None:
        raise DataError(f"{path}: row {line}: column {text_column!r}: missing value")
    q_strong, q_weak = (
        (_number(path, line, cells, "q_strong"), _number(path, line, cells, "q_weak"))
        if labelled
        else (float("nan"), float("nan"))
    )
    if text_column == "prompt":
        return Row(cells, {"messages": [{"role": "user", "content": raw}]}, len(raw), q_strong, q_weak)
    try:
        messages = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: row {line}: column 'messages': not JSON ({exc.msg}): {raw[:60]!r}") from exc
    if not isinstance(messages, list):
        raise DataError(f"{path}: row {line}: column 'messages': expected a JSON array, got {raw[:60]!r}")
    chars = sum(
        len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str)
    )
    return Row(cells, {"messages": messages}, chars, q_strong, q_weak)


def _number(path: str, line: int, cells: dict[str, str], column: str) -> float:
    value = cells.get(column)
    try:
        number = float(value) if value is not None else float("nan")
    except ValueError:
        number = float("nan")
    if not np.isfinite(number):
        raise DataError(f"{path}: row {line}: column {column!r}: value {value!r} is not a number")
    return number


def _training_code() -> ModuleType:
    """scikit-learn and scipy load only for the commands that train or evaluate: every command, `serve`
    included, builds this module's parser, and importing them costs about 1 s and 70 MB per process."""
    from gateway.classifier import training as classifier_train

    return classifier_train


def read_examples(path: str, group_by: str | None = None) -> list[Example]:
    """Labelled rows as training examples (features extracted as the gateway would)."""
    example = _training_code().Example
    examples = []
    for row in read_rows(path, labelled=True):
        if group_by is not None and group_by not in row.cells:
            raise DataError(f"{path}: no column {group_by!r} to group by; found {list(row.cells)}")
        examples.append(
            example(
                features=extract(row.body, "chat"),
                q_strong=row.q_strong,
                q_weak=row.q_weak,
                group=row.cells.get(group_by, "") if group_by else "",
                prompt_chars=row.prompt_chars,
            )
        )
        if len(examples) % PROGRESS_EVERY_ROWS == 0:
            progress(f"read {len(examples)} rows")
    if not examples:
        raise DataError(f"{path}: no data rows")
    return examples


def load_model(path: str | None) -> Classifier:
    return Classifier.load(path) if path else Classifier.default()


def _train_examples(args: argparse.Namespace) -> tuple[list[Example], dict[str, Any]]:
    """The CSV's examples plus those of the labels file, and what the model's meta records about them."""
    if not args.data and not args.labels:
        raise DataError("give --data CSV, --labels JSONL or both")
    examples = read_examples(args.data, args.group_by) if args.data else []
    if args.data:
        progress(f"{len(examples)} rows read from {args.data}")
    if not args.labels:
        return examples, {"data": Path(args.data).name}
    from gateway.classifier.traffic import label_examples

    found = label_examples(args.labels, args.labels_weight, args.request_log)
    progress(f"{args.labels}: {found.summary()} (rows without prompt text are skipped: their prompts were "
             "not kept; see AGENT_GATEWAY_REQUEST_LOG_PROMPTS)")
    if not found.examples:
        raise DataError(f"{args.labels}: no label row has prompt text to train on ({found.summary()})")
    meta = {"data": Path(args.data).name if args.data else None, "labels": Path(args.labels).name,
            "label_rows": len(found.examples), "labels_weight": args.labels_weight,
            "label_rows_skipped": dict(found.skipped)}
    return examples + found.examples, meta


@_guarded
def run_train(args: argparse.Namespace) -> int:
    examples, sources = _train_examples(args)
    cv_meta: dict[str, Any] = {}
    boost = 0.0
    train = _training_code()
    if args.group_by and args.cv:
        scores = train.cross_validate(examples, args.cv, progress, _training(args))
        print(f"{args.cv}-fold cross-validation, whole {args.group_by!r} groups held out:")
        cv_meta = {"plain": _print_figures(examples, scores, None)}
        if args.tune_length_boost:
            boost, tuned = train.tune_length_boost(scores, examples)
            print(f"with the length boost {boost} tuned on these out-of-fold scores:")
            cv_meta["length_boost"] = {"boost": boost, **_print_figures(examples, tuned, args.plot)}
    progress("fitting the final model on all rows")
    model = train.fit(examples, _training(args)).model
    if boost:
        model = train.with_length_boost(model, examples, boost)
    model.meta.update({**sources, "cv": cv_meta, "group_by": args.group_by})
    model.save(args.out)
    progress(f"wrote {args.out} ({Path(args.out).stat().st_size / 1e6:.1f} MB)")
    return 0


@_guarded
def run_score(args: argparse.Namespace) -> int:
    model = load_model(args.model)
    started = time.perf_counter()
    count = 0
    with open_text(args.out, "w") as out:
        writer: csv.DictWriter[str] | None = None
        for row in read_rows(args.data, labelled=False):
            if writer is None:
                writer = csv.DictWriter(out, fieldnames=[*row.cells.keys(), "score"])
                writer.writeheader()
            writer.writerow({**row.cells, "score": f"{model.score(extract(row.body, 'chat')):.6f}"})
            count += 1
            if count % PROGRESS_EVERY_ROWS == 0:
                progress(f"scored {count} rows")
    progress(f"scored {count} rows in {time.perf_counter() - started:.1f} s -> {args.out}")
    return 0


@_guarded
def run_eval(args: argparse.Namespace) -> int:
    if args.cv is not None and args.model:
        raise DataError("use either --model or --cv, not both")
    if args.cv is not None and args.cv < 2:
        raise DataError(f"--cv must be at least 2, got {args.cv}")
    examples = read_examples(args.data, args.group_by)
    if args.cv:
        scores = _training_code().cross_validate(examples, args.cv, progress, _training(args))
    else:
        model = load_model(args.model)
        scores = np.array([model.score(e.features) for e in examples])
    _print_figures(examples, scores, args.plot)
    return 0


def _print_figures(examples: list[Example], scores: Any, plot_path: str | None) -> dict[str, Any]:
    train = _training_code()
    results = train.compare_routers(np.asarray(scores, dtype=np.float64), examples)
    strong = float(np.mean([e.q_strong for e in examples]))
    weak = float(np.mean([e.q_weak for e in examples]))
    for line in train.report(results, strong, weak):
        print(line)
    if plot_path:
        train.plot(results, strong, weak, plot_path)
        progress(f"wrote {plot_path}")
    return {name: {"apgr": s.apgr, "cpt50": s.cpt50, "cpt80": s.cpt80} for name, (s, _) in results.items()}


@_guarded
def run_calibrate(args: argparse.Namespace) -> int:
    if not 0.0 <= args.target_hq_share <= 1.0:
        raise DataError(f"--target-hq-share must be within [0, 1], got {args.target_hq_share}")
    model = load_model(args.model)
    scores = [model.score(_features(row.body)) for row in read_rows(args.data, labelled=False)]
    if not scores:
        raise DataError(f"{args.data}: no data rows")
    calibration = Calibration.from_scores(scores, {"data": Path(args.data).name, "rows": len(scores)})
    threshold = calibration.threshold_for_share(args.target_hq_share)
    share = float(np.mean(np.asarray(scores) >= threshold))
    print(
        f"threshold {threshold:.6f} sends {share:.1%} of {len(scores)} rows to HQ "
        f"(target {args.target_hq_share:.1%})"
    )
    if args.out:
        calibration.save(args.out)
        progress(f"wrote {args.out}")
    return 0


def _features(body: dict[str, Any]) -> Features:
    return extract(body, "chat")
