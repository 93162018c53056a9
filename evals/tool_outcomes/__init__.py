"""Precision and recall of "the tool failed" on the labelled set, for the old word check and the new verdict.

    python -m evals.tool_outcomes [--file evals/tool_outcomes/labelled.jsonl.gz]

A failure is a non-zero exit code. Figures come apart by what the text carries, because reading a harness's own
exit code out of its text is no achievement: "as shown" is each mini-swe-agent observation as the agent's next
prompt showed it (its `<returncode>` line included: the structured signal the verdict reads); "output alone" is
the same observations with that line taken out plus the commands run in this repository, whose texts never
carried an exit code: there only the shape of the words can tell; "real agents" are the results Codex CLI and
Claude Code sent back in our own runs (agent_runs.py), as they sent them (Claude Code's `is_error` included).
"""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.agents.tool_outcomes import judge

LABELLED = Path(__file__).resolve().parent / "labelled.jsonl.gz"
TARGET = 0.85
# The check the gateway used before (gateway/steps.py until this set was made), kept here to be measured against.
OLD_MARKERS = re.compile(
    r"\b(error|exception|traceback|failed|failure|not found|denied|forbidden|timed out|invalid)\b|\"error\"\s*:",
    re.IGNORECASE,
)
OLD_SCAN_CHARS = 2_000
# mini-swe-agent's wrapper around a command's output: its return code, its notes and tags, never the command's words
SHOWN, ALONE, HERE = "as shown (exit code in the text)", "output alone (no exit code)", "  of which this repository's"
AGENTS = "real agents, as they sent them"
AGENT_SOURCES = ("codex", "claude-code")
_WRAPPER = re.compile(r"\A<returncode>-?\d+</returncode>\n?|<warning>.*?</warning>|<elided_chars>.*?</elided_chars>"
                      r"|</?output(?:_head|_tail)?>\n?", re.DOTALL)


@dataclass(frozen=True)
class Figures:
    cases: int
    failed: int  # cases whose exit code was not 0
    true_positives: int
    false_positives: int

    @property
    def precision(self) -> float:
        flagged = self.true_positives + self.false_positives
        return self.true_positives / flagged if flagged else 1.0

    @property
    def recall(self) -> float:
        return self.true_positives / self.failed if self.failed else 1.0


def load(path: Path = LABELLED) -> list[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as rows:
        return [json.loads(line) for line in rows]


def output_alone(text: str) -> str:
    """A mini-swe-agent observation as the command printed it: the harness's return code and wrapper taken out."""
    return _WRAPPER.sub("", text)


@dataclass(frozen=True)
class Case:
    text: str
    failed: bool  # the label: the exit code was not 0
    is_error: bool | None = None  # the API's own flag, where the agent sent one (Claude Code's tool_result)


def views(rows: Iterable[dict[str, Any]]) -> dict[str, list[Case]]:
    """The cases: as the harness showed them (its exit code in the text), output alone, and real agents' results."""
    shown: list[Case] = []
    alone: list[Case] = []
    here: list[Case] = []
    agents: list[Case] = []
    for row in rows:
        failed = row["exit_code"] != 0
        if row["source"] == "mini-swe-agent":
            shown.append(Case(row["text"], failed))
            alone.append(Case(output_alone(row["text"]), failed))
        elif row["source"] in AGENT_SOURCES:
            agents.append(Case(row["text"], failed, row.get("is_error")))
        else:
            alone.append(Case(row["text"], failed))
            here.append(Case(row["text"], failed))
    return {SHOWN: shown, ALONE: alone, HERE: here, AGENTS: agents}


def old_check(case: Case) -> bool:
    return OLD_MARKERS.search(case.text[:OLD_SCAN_CHARS]) is not None


def new_check(case: Case) -> bool:
    return judge(case.text, case.is_error).failed is True


def figures(cases: Iterable[Case], check: Callable[[Case], bool]) -> Figures:
    counts = Counter((case.failed, check(case)) for case in cases)
    return Figures(sum(counts.values()), counts[True, True] + counts[True, False], counts[True, True],
                   counts[False, True])


def report(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'cases':<36} {'n':>6} {'failed':>6}   {'old P':>6} {'old R':>6}   {'new P':>6} {'new R':>6}"]
    for name, cases in views(rows).items():
        old, new = figures(cases, old_check), figures(cases, new_check)
        lines.append(f"{name:<36} {new.cases:>6} {new.failed:>6}   {old.precision:>6.3f} {old.recall:>6.3f}   "
                     f"{new.precision:>6.3f} {new.recall:>6.3f}")
    for name, cases in views(rows).items():
        sources = Counter((str(judge(c.text, c.is_error).source), c.failed) for c in cases)
        shown = ", ".join(f"{s} {sources[s, True]}/{sources[s, True] + sources[s, False]}"
                          for s in sorted({s for s, _ in sources}))
        lines.append(f"verdict sources, {name} (failed/all): {shown}")
    return "\n".join(lines)
