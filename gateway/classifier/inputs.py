"""The structured inputs a classifier may use, by the name its artifact stores: each reads a request as one float.

Each input is written once, as the source of a Python expression over the features `f` and the cues `c`. From
that source come both the per-input functions (training, explanations) and a model's whole structured part
compiled into one function (`compile_terms`): in the running gateway, 23 lambda calls and their helpers cost
~10 µs a request, the compiled sum ~2.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from gateway.classifier.cues import KINDS, Cues
from gateway.features import Features

Input = Callable[[Features, Cues], float]


def _log1p(value: str) -> str:
    """log1p of a count, negatives read as 0 (max(value, 0.0) without the builtin's call: the same value)."""
    return f"log1p(0.0 if {value} < 0.0 else {value})"


# Read from the features: sizes of the conversation's parts, tools, markers, what the caller asked for.
CONVERSATION: dict[str, str] = {
    "prompt_tokens": _log1p("f.prompt_tokens"),
    "last_user_tokens": _log1p("f.last_user_tokens"),
    "history_tokens": _log1p("f.history_tokens"),
    "system_tokens": _log1p("f.system_tokens"),
    "message_count": _log1p("f.message_count"),
    "tools_count": _log1p("f.tools_count"),
    "tool_result_turns": _log1p("f.tool_result_turns"),
    "has_code": "float(f.has_code)",
    "has_math": "float(f.has_math)",
    "json_output": "float(f.response_format in ('json_object', 'json_schema'))",
    "max_tokens": _log1p("(f.max_tokens or 0)"),
}

# Read from the cues: what the ask asks for, in terms that hold across kinds of task.
TASK: dict[str, str] = {
    "ask_chars": _log1p("c.ask_chars"),
    "shots": _log1p("c.shots"),
    "options": "float(min(c.options, 10))",
    "choice": "float(c.options >= 2)",
    "letter_only": "float(c.letter_only)",
    "digits": _log1p("c.digits"),
    "latex": "float(c.latex)",
    "word_problem": "float(c.word_problem)",
    "code_request": "float(c.code_request)",
    "open_ended": "float(c.open_ended)",
    "reasoning": "float(c.reasoning)",
    "negation": "float(c.negation)",
    "question_mark": "float(c.question_mark)",
    "cjk_share": "c.cjk_share",
    "word_chars": "min(c.word_chars, 20.0)",
    "expected_answer_tokens": _log1p("c.expected_answer_tokens"),
}

# One level per kind of task. Per-kind slopes (the ask's length times each kind) were tried and dropped:
# uncentred, they extrapolated a short chat turn ("hi") into the top fifth, and held-out figures were no
# better with them.
KIND: dict[str, str] = {f"kind_{kind}": f"float(c.kind == {kind!r})" for kind in KINDS}

SOURCES: dict[str, str] = CONVERSATION | TASK | KIND
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
    high), the constants written into the code as exact float literals."""
    lines = ["def terms(f, c, z):"]
    for name, mean, slope, low, high in terms:
        lines.append(f"    v = {SOURCES[name]}")
        lines.append(f"    z += {slope!r} * (({low!r} if v < {low!r} else {high!r} if v > {high!r} else v) - {mean!r})")
    lines.append("    return z")
    namespace: dict[str, Any] = dict(_NAMESPACE)
    exec("\n".join(lines), namespace)  # the sources above and float reprs: nothing from a request
    compiled: Terms = namespace["terms"]
    return compiled
