"""The structured inputs a classifier may use, by the name its artifact stores: each reads a request as one float."""

from __future__ import annotations

import math
from collections.abc import Callable

from gateway.classifier.cues import KINDS, Cues
from gateway.features import Features

Input = Callable[[Features, Cues], float]


def _log1p(value: float) -> float:
    return math.log1p(0.0 if value < 0.0 else value)  # max(value, 0.0) without the builtin's call: the same value


# Read from the features: sizes of the conversation's parts, tools, markers, what the caller asked for.
CONVERSATION: dict[str, Input] = {
    "prompt_tokens": lambda f, c: _log1p(f.prompt_tokens),
    "last_user_tokens": lambda f, c: _log1p(f.last_user_tokens),
    "history_tokens": lambda f, c: _log1p(f.history_tokens),
    "system_tokens": lambda f, c: _log1p(f.system_tokens),
    "message_count": lambda f, c: _log1p(f.message_count),
    "tools_count": lambda f, c: _log1p(f.tools_count),
    "tool_result_turns": lambda f, c: _log1p(f.tool_result_turns),
    "has_code": lambda f, c: float(f.has_code),
    "has_math": lambda f, c: float(f.has_math),
    "json_output": lambda f, c: float(f.response_format in ("json_object", "json_schema")),
    "max_tokens": lambda f, c: _log1p(f.max_tokens or 0),
}

# Read from the cues: what the ask asks for, in terms that hold across kinds of task.
TASK: dict[str, Input] = {
    "ask_chars": lambda f, c: _log1p(c.ask_chars),
    "shots": lambda f, c: _log1p(c.shots),
    "options": lambda f, c: float(min(c.options, 10)),
    "choice": lambda f, c: float(c.options >= 2),
    "letter_only": lambda f, c: float(c.letter_only),
    "digits": lambda f, c: _log1p(c.digits),
    "latex": lambda f, c: float(c.latex),
    "word_problem": lambda f, c: float(c.word_problem),
    "code_request": lambda f, c: float(c.code_request),
    "open_ended": lambda f, c: float(c.open_ended),
    "reasoning": lambda f, c: float(c.reasoning),
    "negation": lambda f, c: float(c.negation),
    "question_mark": lambda f, c: float(c.question_mark),
    "cjk_share": lambda f, c: c.cjk_share,
    "word_chars": lambda f, c: min(c.word_chars, 20.0),
    "expected_answer_tokens": lambda f, c: _log1p(c.expected_answer_tokens),
}


def _is_kind(kind: str) -> Input:
    return lambda f, c: float(c.kind == kind)


# One level per kind of task. Per-kind slopes (the ask's length times each kind) were tried and dropped:
# uncentred, they extrapolated a short chat turn ("hi") into the top fifth, and held-out figures were no
# better with them.
KIND: dict[str, Input] = {f"kind_{kind}": _is_kind(kind) for kind in KINDS}

INPUTS: dict[str, Input] = CONVERSATION | TASK | KIND
# Inputs that read only the features: a model that uses no other one never reads the cues.
FEATURES_ONLY = frozenset(CONVERSATION)
