"""The structured inputs a classifier may use, by the name its artifact stores: each reads a request as one float.

Each input is written once, as a Source: one attribute of the features `f` or the cues `c` and an operation on
it. From that come both the per-input functions (training, explanations; summed one by one, the reference the
tests hold the sum to), as Python expressions, and a model's whole structured part summed by one call
(`compile_terms`): in the running gateway one compiled Python sum costs less than the 23 lambda calls and their
helpers it replaced. A C table did it in fewer instructions still and was removed: what it saved a request,
on calls of 0.1 s and more, did not pay for its C, its build flags and its bit-for-bit tests (docs/performance.md,
'Why the code is shaped so').
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.classifier.cues import KINDS, Cues
from gateway.features import Features

Input = Callable[[Features, Cues], float]


@dataclass(frozen=True, slots=True)
class Source:
    """How an input reads a request: one attribute of the features (`f`) or the cues (`c`), and what is made of
    it (`op`, one of OPS), from which its Python expression is written."""

    reads: str  # "f" or "c"
    attr: str
    op: str
    arg: Any = None

    @property
    def expression(self) -> str:
        value = f"{self.reads}.{self.attr}"
        return OPS[self.op].format(x=value, arg=self.arg)


# Each operation's Python expression over the value x.
OPS: dict[str, str] = {
    "log1p": "log1p(0.0 if {x} < 0.0 else {x})",  # a count's log, negatives as 0 (max() without the call)
    "log1p_or_zero": "log1p(0.0 if ({x} or 0) < 0.0 else ({x} or 0))",  # the same, None read as 0
    "float": "float({x})",
    "in": "float({x} in {arg!r})",
    "min": "float(min({x}, {arg!r}))",
    "gte": "float({x} >= {arg!r})",
    "value": "{x}",
    "eq": "float({x} == {arg!r})",
}


def _f(attr: str, op: str = "log1p", arg: Any = None) -> Source:
    return Source("f", attr, op, arg)


def _c(attr: str, op: str = "log1p", arg: Any = None) -> Source:
    return Source("c", attr, op, arg)


# Read from the features: sizes of the conversation's parts, tools, markers, what the caller asked for.
CONVERSATION: dict[str, Source] = {
    "prompt_tokens": _f("prompt_tokens"),
    "last_user_tokens": _f("last_user_tokens"),
    "history_tokens": _f("history_tokens"),
    "system_tokens": _f("system_tokens"),
    "message_count": _f("message_count"),
    "tools_count": _f("tools_count"),
    "tool_result_turns": _f("tool_result_turns"),
    "has_code": _f("has_code", "float"),
    "has_math": _f("has_math", "float"),
    "json_output": _f("response_format", "in", ("json_object", "json_schema")),
    "max_tokens": _f("max_tokens", "log1p_or_zero"),
}

# Read from the cues: what the ask asks for, in terms that hold across kinds of task.
TASK: dict[str, Source] = {
    "ask_chars": _c("ask_chars"),
    "shots": _c("shots"),
    "options": _c("options", "min", 10),
    "choice": _c("options", "gte", 2),
    "letter_only": _c("letter_only", "float"),
    "digits": _c("digits"),
    "latex": _c("latex", "float"),
    "word_problem": _c("word_problem", "float"),
    "code_request": _c("code_request", "float"),
    "open_ended": _c("open_ended", "float"),
    "reasoning": _c("reasoning", "float"),
    "negation": _c("negation", "float"),
    "question_mark": _c("question_mark", "float"),
    "cjk_share": _c("cjk_share", "value"),
    "word_chars": _c("word_chars", "min", 20.0),
    "expected_answer_tokens": _c("expected_answer_tokens"),
}

# One level per kind of task. Per-kind slopes (the ask's length times each kind) were tried and dropped:
# uncentred, they extrapolated a short chat turn ("hi") into the top fifth, and held-out figures were no
# better with them.
KIND: dict[str, Source] = {f"kind_{kind}": _c("kind", "eq", kind) for kind in KINDS}

READS: dict[str, Source] = CONVERSATION | TASK | KIND
SOURCES: dict[str, str] = {name: source.expression for name, source in READS.items()}
# The names the compiled expressions read besides `f` and `c`; inf and nan for a term's non-finite constants.
_NAMESPACE = {"log1p": math.log1p, "float": float, "min": min, "inf": math.inf, "nan": math.nan}


def _function(source: str) -> Input:
    function: Input = eval(f"lambda f, c: {source}", dict(_NAMESPACE))  # our own constant sources
    return function


INPUTS: dict[str, Input] = {name: _function(source) for name, source in SOURCES.items()}
# Inputs that read only the features: a model that uses no other one never reads the cues.
FEATURES_ONLY = frozenset(CONVERSATION)

Terms = Callable[[Features, Cues, float], float]


def compile_terms(terms: Sequence[tuple[str, float, float, float, float]]) -> Terms:
    """One function adding each term's `slope * (clamp(value, low, high) - mean)` to z, in the order given (so
    the sum is the same float as a loop over the terms would make): terms are (input name, mean, slope, low,
    high). Written as Python, the constants as exact float literals."""
    lines = ["def terms(f, c, z):"]
    for name, mean, slope, low, high in terms:
        lines.append(f"    v = {SOURCES[name]}")
        lines.append(f"    z += {slope!r} * (({low!r} if v < {low!r} else {high!r} if v > {high!r} else v) - {mean!r})")
    lines.append("    return z")
    namespace: dict[str, Any] = dict(_NAMESPACE)
    exec("\n".join(lines), namespace)  # the sources above and float reprs: nothing from a request
    compiled: Terms = namespace["terms"]
    return compiled
