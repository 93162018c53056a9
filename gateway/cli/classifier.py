"""The `classifier` command: train, score, eval and calibrate from CSV files of labelled prompts."""

from __future__ import annotations

import argparse
import csv
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

# numpy is imported inside the commands that use it: `serve` parses this CLI, and a serving gateway never needs
# numpy, nor its memory (tests/server/test_serving_imports.py).
from gateway.classifier.inputs import INPUTS
from gateway.classifier.options import DEFAULT_OPTIONS, TARGETS, TrainingOptions
from gateway.classifier.scoring import Calibration, Classifier, ModelFileError
from gateway.cli.classifier_data import (
    PROGRESS_EVERY_ROWS,
    DataError,
    open_text,
    progress,
    read_examples,
    read_rows,
    read_sets,
)
from gateway.features import Features, extract

if TYPE_CHECKING:
    from types import ModuleType

    from gateway.classifier.training import Example


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `classifier train|score|eval|calibrate` to the top-level parser."""
    parser = subparsers.add_parser(
        "classifier", help="train, score, evaluate and calibrate the complexity classifier"
    )
    commands = parser.add_subparsers(dest="classifier_command", required=True)

    train = commands.add_parser("train", help="fit a model on CSV rows (prompt|messages, q_strong, q_weak)")
    _add_data_arguments(train, "CSV or CSV.gz file (needed unless --sets or --labels is given)", required=False)
    train.add_argument("--labels", help="JSONL of shadow-pair labels (`agent-gateway shadow labels`), beside --data")
    train.add_argument("--labels-weight", type=float, default=1.0,
                       help="each label row weighs this many CSV rows in the fit (default: %(default)s)")
    train.add_argument("--request-log", help="request log JSONL kept with prompts: gives labels without one "
                       "their prompt (by request id)")
    train.add_argument("--out", required=True, help="where to write the JSON model")
    train.add_argument("--group-by", help="column to group by for the cross-validation run before fitting")
    train.add_argument("--cv", type=int, default=5, help="folds for that run (with --group-by; 0 skips it)")
    train.add_argument(
        "--leave-one-out",
        action="store_true",
        help="with --sets: before fitting, score each benchmark with a model trained on the others",
    )
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
    _add_data_arguments(evaluate)
    evaluate.add_argument("--model", help="JSON model to evaluate (default: the packaged one)")
    evaluate.add_argument("--cv", type=int, help="cross-validate K folds instead of using a model")
    evaluate.add_argument("--group-by", help="column whose values are held out together in --cv")
    evaluate.add_argument(
        "--leave-one-out",
        action="store_true",
        help="instead of using a model, score each benchmark (--sets) or --group-by value with a model "
        "trained on all the others; figures per dataset and on a mixed stream",
    )
    _add_training_arguments(evaluate)
    evaluate.add_argument("--plot", help="write the quality-vs-HQ-share curve to this PNG")
    evaluate.set_defaults(func=run_eval)

    calibrate = commands.add_parser("calibrate", help="threshold that sends a target share of traffic to HQ")
    _add_data_arguments(calibrate, "representative traffic: a CSV (prompt|messages), or --sets for a mixed stream")
    calibrate.add_argument("--target-hq-share", type=float, required=True, help="e.g. 0.3 for 30%%")
    calibrate.add_argument("--model", help="JSON model (default: the packaged one)")
    calibrate.add_argument("--out", help="also write a calibration JSON file for policies")
    calibrate.set_defaults(func=run_calibrate)


def _add_data_arguments(
    parser: argparse.ArgumentParser, data_help: str = "CSV or CSV.gz file", required: bool = True
) -> None:
    source = parser.add_mutually_exclusive_group(required=required)
    source.add_argument("--data", help=data_help)
    source.add_argument(
        "--sets",
        help="YAML manifest of labelled sets (files, datasets, benchmarks), e.g. "
        "gateway/classifier/models/default.sets.yaml",
    )
    parser.add_argument("--data-dir", help="where the manifest's files are (default: its data_dir)")


def _add_training_arguments(parser: argparse.ArgumentParser) -> None:
    default = DEFAULT_OPTIONS
    parser.add_argument("--c", type=float, default=default.c, help="inverse L2 regularization strength")
    parser.add_argument(
        "--target",
        choices=TARGETS,
        default=default.target,
        help="fast-fails: P(fast's answer is wrong); gap: P(HQ's answer is better) (default: %(default)s)",
    )
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
    parser.add_argument("--without-text", action="store_true", help="no n-gram block: structured inputs only")
    parser.add_argument(
        "--without-inputs",
        default="",
        metavar="NAME,...",
        help="structured inputs to leave out (for ablations), among: " + ", ".join(DEFAULT_OPTIONS.numeric),
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
        help="with --target gap: weight of rows where the fast deployment answered better (default: %(default)s)",
    )


def _training(args: argparse.Namespace) -> TrainingOptions:
    """The training options chosen on the command line."""
    if args.min_df < 1:
        raise DataError(f"--min-df must be at least 1, got {args.min_df}")
    if args.fast_wins_weight < 0:
        raise DataError(f"--fast-wins-weight must be at least 0, got {args.fast_wins_weight}")
    dropped = [name for name in args.without_inputs.split(",") if name]
    unknown = [name for name in dropped if name not in INPUTS]
    if unknown:
        raise DataError(f"--without-inputs: unknown input(s) {unknown}")
    try:
        text = replace(DEFAULT_OPTIONS.text, ngram_min=args.ngram[0], ngram_max=args.ngram[1])
    except ValueError as exc:
        raise DataError(f"--ngram: {exc}") from exc
    return replace(
        DEFAULT_OPTIONS,
        text=text,
        min_df=args.min_df,
        use_text=not args.without_text,
        c=args.c,
        numeric_weight=args.numeric_weight,
        fast_wins_weight=args.fast_wins_weight,
        numeric=tuple(name for name in DEFAULT_OPTIONS.numeric if name not in dropped),
        target=args.target,
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


def _training_code() -> ModuleType:
    """scikit-learn and scipy load only for the commands that train or evaluate: every command, `serve`
    included, builds this module's parser, and importing them would add time and memory to every process
    (docs/performance.md, 'Why the code is shaped so')."""
    from gateway.classifier import training as classifier_train

    return classifier_train


def _evaluation_code() -> ModuleType:
    from gateway.classifier import evaluation

    return evaluation


def _examples(args: argparse.Namespace) -> list[Example]:
    """The labelled rows of --data (grouped by --group-by) or of the --sets manifest."""
    if args.sets:
        if args.group_by:
            raise DataError("--group-by applies to --data; a --sets manifest names each row's benchmark")
        return read_sets(args.sets, args.data_dir)
    examples = read_examples(args.data, args.group_by)
    progress(f"{len(examples)} rows read from {args.data}")
    return examples


def load_model(path: str | None) -> Classifier:
    return Classifier.load(path) if path else Classifier.default()


def _train_examples(args: argparse.Namespace) -> tuple[list[Example], dict[str, Any]]:
    """The CSV's or the manifest's examples plus those of the labels file, and what the model's meta records
    about them."""
    if not args.data and not args.sets and not args.labels:
        raise DataError("give --data CSV or --sets MANIFEST, --labels JSONL, or both")
    examples = _examples(args) if args.data or args.sets else []
    source = Path(args.sets or args.data).name if args.data or args.sets else None
    if not args.labels:
        return examples, {"data": source}
    from gateway.classifier.traffic_examples import label_examples

    found = label_examples(args.labels, args.labels_weight, args.request_log)
    progress(f"{args.labels}: {found.summary()} (rows without prompt text are skipped: their prompts were "
             "not kept; see AGENT_GATEWAY_REQUEST_LOG_PROMPTS)")
    if not found.examples:
        raise DataError(f"{args.labels}: no label row has prompt text to train on ({found.summary()})")
    meta = {"data": source, "labels": Path(args.labels).name, "label_rows": len(found.examples),
            "labels_weight": args.labels_weight, "label_rows_skipped": dict(found.skipped)}
    return examples + [replace(e, dataset=Path(args.labels).name) for e in found.examples], meta


@_guarded
def run_train(args: argparse.Namespace) -> int:
    if args.leave_one_out and not args.sets:
        raise DataError("--leave-one-out in train needs --sets (benchmarks to hold out)")
    examples, sources = _train_examples(args)
    cv_meta: dict[str, Any] = {}
    boost = 0.0
    train = _training_code()
    if args.leave_one_out:
        scores = train.hold_out_each(examples, progress, _training(args))
        print("each benchmark held out in turn, scored by a model trained on the others:")
        cv_meta = {"leave_one_out": _print_datasets(examples, scores, args.plot)}
    elif args.group_by and args.cv:
        scores = train.cross_validate(examples, args.cv, progress, _training(args))
        print(f"{args.cv}-fold cross-validation, whole {args.group_by!r} groups held out:")
        cv_meta = {"plain": _print_figures(examples, scores, None)}
        if args.tune_length_boost:
            boost, tuned = train.tune_length_boost(scores, examples)
            print(f"with the length boost {boost} tuned on these out-of-fold scores:")
            cv_meta["length_boost"] = {"boost": boost, **_print_figures(examples, tuned, args.plot)}
    progress(f"fitting the final model on all {len(examples)} rows")
    model = train.fit(examples, _training(args)).model
    if boost:
        model = train.with_length_boost(model, examples, boost)
    model.meta.update({**sources, "cv": cv_meta, "group_by": args.group_by, "datasets": _sizes(examples)})
    model.save(args.out)
    progress(f"wrote {args.out} ({Path(args.out).stat().st_size / 1e6:.1f} MB)")
    return 0


def _sizes(examples: list[Example]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for e in examples:
        sizes[e.dataset] = sizes.get(e.dataset, 0) + 1
    return sizes


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
    import numpy as np
    if sum((args.cv is not None, bool(args.model), args.leave_one_out)) > 1:
        raise DataError("use one of --model, --cv and --leave-one-out")
    if args.cv is not None and args.cv < 2:
        raise DataError(f"--cv must be at least 2, got {args.cv}")
    if args.leave_one_out and not (args.sets or args.group_by):
        raise DataError("--leave-one-out needs --sets or --group-by (what to hold out)")
    examples = _examples(args)
    if args.leave_one_out:
        scores = _training_code().hold_out_each(examples, progress, _training(args))
    elif args.cv:
        scores = _training_code().cross_validate(examples, args.cv, progress, _training(args))
    else:
        model = load_model(args.model)
        scores = np.array([model.score(e.features) for e in examples])
    if args.sets or args.leave_one_out:
        _print_datasets(examples, scores, args.plot)
    else:
        _print_figures(examples, scores, args.plot)
    return 0


def _print_figures(examples: list[Example], scores: Any, plot_path: str | None) -> dict[str, Any]:
    import numpy as np
    evaluation = _evaluation_code()
    results = evaluation.compare_routers(np.asarray(scores, dtype=np.float64), examples)
    strong = float(np.mean([e.q_strong for e in examples]))
    weak = float(np.mean([e.q_weak for e in examples]))
    for line in evaluation.report(results, strong, weak):
        print(line)
    if plot_path:
        evaluation.plot(results, strong, weak, plot_path)
        progress(f"wrote {plot_path}")
    return {name: {"apgr": s.apgr, "cpt50": s.cpt50, "cpt80": s.cpt80} for name, (s, _) in results.items()}


def _print_datasets(examples: list[Example], scores: Any, plot_path: str | None) -> dict[str, Any]:
    """The table per dataset and on the mixed stream (plotted when asked); the figures as a dict."""
    import numpy as np
    evaluation = _evaluation_code()
    tables = evaluation.by_dataset(np.asarray(scores, dtype=np.float64), examples)
    for line in evaluation.dataset_report(tables):
        print(line)
    if plot_path:
        mixed = [examples[i] for i in evaluation.mixed_stream(examples)]
        strong, weak = (float(np.mean([getattr(e, q) for e in mixed])) for q in ("q_strong", "q_weak"))
        evaluation.plot(tables[evaluation.MIXED][1], strong, weak, plot_path)
        progress(f"wrote {plot_path}")
    return {
        name: {router: {"apgr": s.apgr, "cpt50": s.cpt50, "cpt80": s.cpt80} for router, (s, _) in results.items()}
        for name, (_, results) in tables.items()
    }


@_guarded
def run_calibrate(args: argparse.Namespace) -> int:
    import numpy as np
    if not 0.0 <= args.target_hq_share <= 1.0:
        raise DataError(f"--target-hq-share must be within [0, 1], got {args.target_hq_share}")
    model = load_model(args.model)
    if args.sets:
        examples = read_sets(args.sets, args.data_dir)
        stream = [examples[i].features for i in _evaluation_code().mixed_stream(examples)]
    else:
        stream = [_features(row.body) for row in read_rows(args.data, labelled=False)]
    scores = [model.score(f) for f in stream]
    if not scores:
        raise DataError(f"{args.data}: no data rows")
    source = Path(args.sets or args.data).name
    calibration = Calibration.from_scores(scores, {"data": source, "rows": len(scores)})
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
