"""Labelled prompts for the classifier: CSV files of prompts (or chats) with answer qualities, and the YAML
manifest of labelled sets (files, their datasets, the benchmark each is held out with, how rows are labelled)."""

from __future__ import annotations

import csv
import gzip
import json
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.features import extract

if TYPE_CHECKING:
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
        (number_cell(path, line, cells, "q_strong"), number_cell(path, line, cells, "q_weak"))
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


def number_cell(path: str, line: int, cells: dict[str, str], column: str) -> float:
    value = cells.get(column)
    try:
        number = float(value) if value is not None else float("nan")
    except ValueError:
        number = float("nan")
    if not math.isfinite(number):
        raise DataError(f"{path}: row {line}: column {column!r}: value {value!r} is not a number")
    return number


def read_examples(path: str, group_by: str | None = None) -> list[Example]:
    """Labelled rows as training examples (features extracted as the gateway would)."""
    from gateway.classifier.training import Example

    examples = []
    for row in read_rows(path, labelled=True):
        if group_by is not None and group_by not in row.cells:
            raise DataError(f"{path}: no column {group_by!r} to group by; found {list(row.cells)}")
        examples.append(
            Example(
                features=extract(row.body, "chat"),
                q_strong=row.q_strong,
                q_weak=row.q_weak,
                group=row.cells.get(group_by, "") if group_by else "",
                dataset=row.cells.get(group_by, "") if group_by else Path(path).name,
                prompt_chars=row.prompt_chars,
            )
        )
        if len(examples) % PROGRESS_EVERY_ROWS == 0:
            progress(f"read {len(examples)} rows")
    if not examples:
        raise DataError(f"{path}: no data rows")
    return examples


DEFAULT_SETS_PATH = Path(__file__).parents[1] / "classifier" / "models" / "default.sets.yaml"
SCORE_PREFIX = "score:"


class LabelledFile(BaseModel):
    """One CSV file of the manifest."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    file: str
    name: str  # the first part of each dataset's reported name
    # "pair": rows are labelled by q_strong and q_weak (or the `pair` columns); "fail-share": by the share of
    # the score:* columns that are below 1 on average, for files with no fast deployment of their own
    label: Literal["pair", "fail-share"] = "pair"
    pair: tuple[str, str] = ("q_strong", "q_weak")  # the columns evaluated as HQ and fast
    dataset: str | None = None  # the whole file is this dataset ...
    benchmark: str | None = None  # ... held out with this benchmark
    split_by: str | None = None  # or: a dataset per value of this column
    datasets: dict[str, tuple[str, str]] = Field(default_factory=dict)  # value -> (dataset, benchmark)


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    data_dir: str = "."  # where the files are, relative to the current directory
    sets: tuple[LabelledFile, ...]


def read_manifest(path: str | Path) -> Manifest:
    """The manifest, or a DataError naming the file, field and problem."""
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise DataError(f"{path}: not YAML{where}: {getattr(exc, 'problem', None) or exc}") from exc
    try:
        manifest = Manifest.model_validate(raw)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(part) for part in error["loc"])
        raise DataError(f"{path}: {field}: {error['msg']} (got {error.get('input')!r:.80})") from exc
    for i, entry in enumerate(manifest.sets):
        if (entry.split_by is None) == (entry.dataset is None or entry.benchmark is None):
            raise DataError(
                f"{path}: sets.{i} ({entry.file}): give `dataset` and `benchmark`, or `split_by` and `datasets`"
            )
    return manifest


def read_sets(path: str | Path, data_dir: str | None = None) -> list[Example]:
    """Every row of every file of the manifest as an example, with its dataset and benchmark (as group)."""
    manifest = read_manifest(path)
    folder = Path(data_dir if data_dir is not None else manifest.data_dir)
    examples: list[Example] = []
    for entry in manifest.sets:
        found = read_file(str(folder / entry.file), entry)
        progress(f"{len(found)} rows from {entry.file}")
        examples.extend(found)
    return examples


def read_file(path: str, entry: LabelledFile) -> list[Example]:
    from gateway.classifier.training import Example

    examples = []
    for line, row in enumerate(read_rows(path, labelled=False), start=1):
        dataset, benchmark = _place(path, line, row.cells, entry)
        strong, weak = (number_cell(path, line, row.cells, column) for column in entry.pair)
        examples.append(
            Example(
                features=extract(row.body, "chat"),
                q_strong=strong,
                q_weak=weak,
                group=benchmark,
                prompt_chars=row.prompt_chars,
                dataset=f"{entry.name}/{dataset}",
                fail_share=_fail_share(path, line, row.cells) if entry.label == "fail-share" else None,
            )
        )
    if not examples:
        raise DataError(f"{path}: no data rows")
    return examples


def _place(path: str, line: int, cells: dict[str, str], entry: LabelledFile) -> tuple[str, str]:
    """(dataset, benchmark) of one row."""
    if entry.split_by is None:
        assert entry.dataset is not None and entry.benchmark is not None  # checked by read_manifest
        return entry.dataset, entry.benchmark
    value = cells.get(entry.split_by)
    if value not in entry.datasets:
        raise DataError(f"{path}: row {line}: column {entry.split_by!r}: value {value!r} has no entry in `datasets`")
    return entry.datasets[value]


def _fail_share(path: str, line: int, cells: dict[str, str]) -> float:
    """The share of the score:* models that failed the row (1 - their mean score; empty cells skipped)."""
    scores = [number_cell(path, line, cells, c) for c, v in cells.items() if c.startswith(SCORE_PREFIX) and v != ""]
    if not scores:
        raise DataError(f"{path}: row {line}: no {SCORE_PREFIX}* column has a value")
    return 1.0 - sum(scores) / len(scores)
