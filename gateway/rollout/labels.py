"""A shadow pair as a training label: which side is the reference, how far the answers agree, the judge.

A label says whether the weak side's answer (usually the fast deployment's) was good enough against the
strong side's (the reference, usually hq). The cheap measure is `agreement`; the optional judge is a
deployment asked JUDGE_SYSTEM / JUDGE_USER with the two answers in random order, whose reply must be
exactly one of A, B or TIE (`parse_choice`). The runtime that calls it lives in experiments/labeller.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import Field

from gateway.frozen import Frozen
from gateway.rollout.comparison import Completion, similarity

# The judge's fixed prompt (docs/learning-loop.md quotes it): correctness first, length and style ignored.
JUDGE_SYSTEM = (
    "You compare two answers to the same request. Judge correctness first, then whether the answer "
    "does what the request asks; ignore length, tone and style. Reply with exactly one word: A if "
    "answer A is better, B if answer B is better, TIE if they are equally good or equally bad."
)
JUDGE_USER = "[Request]\n{request}\n\n[Answer A]\n{a}\n\n[Answer B]\n{b}\n\nWhich answer is better? Reply A, B or TIE."
REQUEST_MAX_CHARS = 6000  # the request's tail (the latest turns matter most), so a judge call stays small
ANSWER_MAX_CHARS = 3000
_CHOICE = re.compile(r"\s*(A|B|TIE)\s*\.?\s*", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_SPACE = re.compile(r"\s+")
_EDGE_PUNCTUATION = ".,;:!?\"'`*_ "


class Verdict(StrEnum):
    """The weak side's answer against the strong side's."""

    WEAK_WORSE = "weak_worse"  # not good enough: the request needed the strong deployment
    TIE = "tie"  # as good (or as bad): the weak deployment would have done
    WEAK_BETTER = "weak_better"  # better than the reference


class Skip(StrEnum):
    """Why a pair gives no label."""

    FAILED_SIDE = "failed_side"  # one side has no usable answer (error, timeout, non-2xx)
    TRUNCATED = "truncated"  # the shadow was cut short by its own max_tokens: its answer is not the whole one
    NO_STRONG_SIDE = "no_strong_side"  # neither side (or both) served by the strong deployment
    OTHER_WEAK = "other_weak"  # the other side is not the configured weak deployment
    JUDGE = "judge"  # the judge was asked and gave no verdict (timeout, error, garbage, over its rate)


class JudgeSpec(Frozen):
    """A deployment asked to compare the two answers; bounded in rate, size and time."""

    deployment: str = Field(description="a deployment declared under `deployments:` (often hq itself)")
    rate_per_min: float = Field(30.0, gt=0, description="judge calls per minute at most; more pairs go unlabelled")
    timeout_s: float = Field(10.0, gt=0, description="a judge call's whole time; a late answer labels nothing")
    max_tokens: int = Field(4, ge=1, le=64, description="the reply is one word")
    max_in_flight: int = Field(2, ge=1, le=64, description="judge calls at once; pairs wait in the queue")


class LabelsSpec(Frozen):
    """Turn shadow pairs into training labels for the classifier (policy section `labels:`)."""

    strong: str = Field(description="the deployment whose answer is the reference (usually hq)")
    weak: str | None = Field(None, description="label only pairs against this deployment (default: any other)")
    judge: JudgeSpec | None = None
    agree_similarity: float = Field(
        0.5, ge=0, le=1, description="without a judge: token-set similarity at which answers agree"
    )
    queue: int = Field(256, ge=1, description="pairs waiting for the labeller; more are dropped (counted)")
    max_labels: int = Field(10_000, ge=1, description="labels kept in the store; the oldest go first")
    ttl_s: float = Field(7 * 86400.0, gt=0, description="a label is kept this long")


@dataclass(frozen=True, slots=True)
class Agreement:
    """How far two answers agree, from cheap text checks."""

    exact: bool
    normalized: bool  # equal after case, whitespace and edge punctuation are normalized
    numeric: bool | None  # both end in a number: the same number? (None: one has none)
    similarity: float  # token-set Jaccard (comparison.similarity)

    def agrees(self, min_similarity: float) -> bool:
        if self.exact or self.normalized:
            return True
        if self.numeric is not None:  # a final number decides: "42" vs "41" are close in words, not in value
            return self.numeric
        return self.similarity >= min_similarity

    def to_dict(self) -> dict[str, Any]:
        return {"exact": self.exact, "normalized": self.normalized, "numeric": self.numeric,
                "similarity": round(self.similarity, 4)}


def normalize(text: str) -> str:
    return _SPACE.sub(" ", text.lower()).strip(_EDGE_PUNCTUATION)


def final_number(text: str) -> float | None:
    """The last number in the text (thousands separators dropped), the usual place of an answer."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def agreement(strong: str, weak: str) -> Agreement:
    a, b = final_number(strong), final_number(weak)
    return Agreement(
        exact=strong == weak,
        normalized=normalize(strong) == normalize(weak),
        numeric=None if a is None or b is None else a == b,
        similarity=similarity(strong, weak),
    )


def answer_text(done: Completion) -> str:
    """What an answer says: its text, then its tool calls (a tool-calling answer has little text)."""
    calls = "".join(f"\n[tool call] {c['name']}({c['arguments']})" for c in done.tool_calls)
    return (done.text + calls).strip()


def sides(record: Mapping[str, Any], spec: LabelsSpec) -> tuple[str, str] | Skip:
    """("primary" | "shadow") of the strong side and of the weak side of a compared pair, or why none."""
    primary, shadow = record["primary"], record["shadow"]
    if not (primary.get("ok") and shadow.get("ok")):
        return Skip.FAILED_SIDE
    if record.get("shadow_truncated"):
        return Skip.TRUNCATED
    served = {"primary": primary.get("deployment"), "shadow": shadow.get("deployment")}
    strong = [side for side, name in served.items() if name == spec.strong]
    if len(strong) != 1:
        return Skip.NO_STRONG_SIDE
    weak = "shadow" if strong[0] == "primary" else "primary"
    if spec.weak is not None and served[weak] != spec.weak:
        return Skip.OTHER_WEAK
    return strong[0], weak


def checked(record: Mapping[str, Any], strong: str, weak: str) -> Verdict | None:
    """The verdict objective checks already give: requested JSON or tool calls valid on one side only."""
    for check in ("json_valid", "tool_calls_valid"):
        s, w = record[strong].get(check), record[weak].get(check)
        if s is not None and w is not None and s != w:
            return Verdict.WEAK_BETTER if w else Verdict.WEAK_WORSE
    return None


def request_text(body: Mapping[str, Any]) -> str:
    """The request as the judge reads it: chat turns as `role: text` lines, or the completion prompt."""
    messages = body.get("messages")
    if isinstance(messages, list):
        lines = [f"{m.get('role', 'user')}: {_content_text(m.get('content'))}" for m in messages if isinstance(m, dict)]
        text = "\n".join(lines)
    else:
        prompt = body.get("prompt")
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)
    return text[-REQUEST_MAX_CHARS:]


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def judge_messages(request: str, first: str, second: str) -> list[dict[str, str]]:
    """The judge's chat: the fixed instructions, the request, answer A (`first`) and answer B (`second`)."""
    user = JUDGE_USER.format(request=request, a=first[:ANSWER_MAX_CHARS], b=second[:ANSWER_MAX_CHARS])
    return [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": user}]


def parse_choice(reply: str) -> str | None:
    """"A", "B" or "TIE" when the reply is exactly that word (any case, an optional final period), else None."""
    found = _CHOICE.fullmatch(reply)
    return None if found is None else found.group(1).upper()


def unswapped(choice: str, strong_first: bool) -> Verdict:
    """The judge's choice as a verdict on the weak side, undoing the random order of the answers."""
    if choice == "TIE":
        return Verdict.TIE
    strong_won = (choice == "A") == strong_first
    return Verdict.WEAK_WORSE if strong_won else Verdict.WEAK_BETTER


def good_enough(verdict: Verdict) -> bool:
    return verdict is not Verdict.WEAK_WORSE


def qualities(verdict: Verdict) -> tuple[float, float]:
    """(q_strong, q_weak) as the classifier's CSV has them: 1 where the answer is the better or as good."""
    return {Verdict.WEAK_WORSE: (1.0, 0.0), Verdict.TIE: (1.0, 1.0), Verdict.WEAK_BETTER: (0.0, 1.0)}[verdict]
