"""A session's outcome as data: what the caller reported (success, score, reason, labels), read from the
outcome API's body or the `x-session-outcome` header, and the outcome figures of many sessions by route,
deployment mix and rollout arm (success rate, cost per session, cost per solved task, steps per success)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import BadRequest

HEADER = "x-session-outcome"
HEADER_VALUES = {"success": True, "failure": False}
REASON_MAX_CHARS = 1024
LABELS_MAX = 16
LABEL_KEY_MAX_CHARS = 64
LABEL_VALUE_MAX_CHARS = 256
HISTORY_KEPT = 5  # reports a session keeps: the current one and the ones it replaced, newest last
MIX_MAX_DEPLOYMENTS = 3  # a session served by more deployments than this is the mix "mixed" (bounded labels)


@dataclass(frozen=True, slots=True)
class Outcome:
    """One report of how an agent run ended, with what the session had cost and done when it was reported."""

    success: bool
    score: float | None = None
    reason: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    source: str = "api"  # "api" (POST /v1/sessions/{id}/outcome) or "header" (x-session-outcome on a step)
    at: float = 0.0  # epoch seconds of the report
    cost_usd: float = 0.0  # the session's spend when it was reported (what the counters were given)
    steps: int = 0
    rollout: str = ""  # Membership.encode() of the cohort it was counted in ("": none); kept, never shown

    def to_dict(self) -> dict[str, Any]:
        return {"success": self.success, "score": self.score, "reason": self.reason, "labels": dict(self.labels),
                "source": self.source, "at": round(self.at, 3), "cost_usd": round(self.cost_usd, 9),
                "steps": self.steps}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Outcome:
        score = raw.get("score")
        return cls(bool(raw.get("success")), None if score is None else float(score), str(raw.get("reason", "")),
                   {str(k): str(v) for k, v in (raw.get("labels") or {}).items()}, str(raw.get("source", "api")),
                   float(raw.get("at", 0.0)), float(raw.get("cost_usd", 0.0)), int(raw.get("steps", 0)),
                   str(raw.get("rollout", "")))

    def encode(self) -> str:
        return json.dumps({**self.to_dict(), "rollout": self.rollout}, separators=(",", ":"))

    @property
    def word(self) -> str:
        return "success" if self.success else "failure"


def read_body(body: Any) -> Outcome:
    """The outcome API's JSON body as an Outcome; BadRequest (naming the field) for anything else."""
    if not isinstance(body, dict):
        raise BadRequest('The body must be a JSON object like {"success": true}')
    unknown = sorted(set(body) - {"success", "score", "reason", "labels"})
    if unknown:
        raise BadRequest(f"Unknown field {unknown[0]!r}: an outcome has success, score, reason and labels",
                         param=unknown[0])
    success = body.get("success")
    if not isinstance(success, bool):
        raise BadRequest(f"success must be true or false, got {_shown(success)}", param="success")
    return Outcome(success, _score(body.get("score")), _reason(body.get("reason")), _labels(body.get("labels")))


def _score(score: Any) -> float | None:
    if score is None:
        return None
    if isinstance(score, bool) or not isinstance(score, int | float) or not (0.0 <= score <= 1.0):
        raise BadRequest(f"score must be a number from 0 to 1, got {_shown(score)}", param="score")
    return float(score)


def _reason(reason: Any) -> str:
    if reason is None:
        return ""
    if not isinstance(reason, str) or len(reason) > REASON_MAX_CHARS:
        raise BadRequest(f"reason must be a string of at most {REASON_MAX_CHARS} characters", param="reason")
    return reason


def _labels(labels: Any) -> dict[str, str]:
    if labels is None:
        return {}
    if not isinstance(labels, dict) or len(labels) > LABELS_MAX:
        raise BadRequest(f"labels must be an object of at most {LABELS_MAX} string values", param="labels")
    for key, value in labels.items():
        if not 0 < len(key) <= LABEL_KEY_MAX_CHARS or not isinstance(value, str) \
                or len(value) > LABEL_VALUE_MAX_CHARS:
            raise BadRequest(f"labels.{key[:LABEL_KEY_MAX_CHARS]}: keys of 1-{LABEL_KEY_MAX_CHARS} characters, "
                             f"string values of at most {LABEL_VALUE_MAX_CHARS}", param="labels")
    return dict(labels)


def _shown(value: Any) -> str:
    return json.dumps(value)[:32] if value is not None else "nothing"


def read_header(headers: Mapping[str, str]) -> bool | None:
    """The `x-session-outcome` header of a step: True (success), False (failure), None (absent); BadRequest
    for any other value."""
    raw = headers.get(HEADER)
    if raw is None:
        return None
    found = HEADER_VALUES.get(raw.strip().lower())
    if found is None:
        raise BadRequest(f"{HEADER} must be success or failure, got {raw[:32]!r}", param=HEADER)
    return found


def mix(deployments: Mapping[str, int]) -> str:
    """The deployment mix of a session: the deployments its steps went to, sorted, joined by '+'."""
    names = sorted(name for name, steps in deployments.items() if steps > 0)
    if len(names) > MIX_MAX_DEPLOYMENTS:
        return "mixed"
    return "+".join(names) or "none"


@dataclass(slots=True)
class OutcomeRow:
    """The outcome figures of one (route, deployment mix, arm): what /admin/outcomes lists."""

    route: str
    mix: str
    arm: str
    sessions: int = 0
    successes: int = 0
    cost_usd: float = 0.0
    steps: int = 0
    success_cost_usd: float = 0.0
    success_steps: int = 0

    def add(self, outcome: Outcome) -> None:
        self.sessions += 1
        self.cost_usd += outcome.cost_usd
        self.steps += outcome.steps
        if outcome.success:
            self.successes += 1
            self.success_cost_usd += outcome.cost_usd
            self.success_steps += outcome.steps

    def to_dict(self) -> dict[str, Any]:
        n, k = self.sessions, self.successes
        return {
            "route": self.route, "mix": self.mix, "arm": self.arm, "sessions": n, "successes": k,
            "success_rate": k / n if n else None,
            "cost_per_session_usd": self.cost_usd / n if n else None,
            # what a solved task costs: the failures' spend is charged to the successes
            "cost_per_success_usd": self.cost_usd / k if k else None,
            "cost_per_successful_session_usd": self.success_cost_usd / k if k else None,
            "steps_per_success": self.success_steps / k if k else None,
            "cost_usd": round(self.cost_usd, 9),
        }  # fmt: skip


def rows(sessions: Iterable[tuple[str, str, str, Outcome]]) -> list[OutcomeRow]:
    """(route, mix, arm, outcome) of many sessions as one row per (route, mix, arm), most sessions first."""
    table: dict[tuple[str, str, str], OutcomeRow] = {}
    for route, used, arm, outcome in sessions:
        row = table.get((route, used, arm))
        if row is None:
            row = table[(route, used, arm)] = OutcomeRow(route, used, arm)
        row.add(outcome)
    return sorted(table.values(), key=lambda r: (-r.sessions, r.route, r.mix, r.arm))


@dataclass(frozen=True, slots=True)
class Membership:
    """The rollout window and cohort a session's steps were measured in (its outcome counts there)."""

    rollout_id: str
    run: int
    window: int
    cohort: str  # candidate or control

    def encode(self) -> str:
        return f"{self.rollout_id}\t{self.run}\t{self.window}\t{self.cohort}"

    @classmethod
    def decode(cls, raw: str) -> Membership | None:
        parts = raw.split("\t")
        if len(parts) != 4 or not parts[1].isdigit() or not parts[2].isdigit():
            return None
        return cls(parts[0], int(parts[1]), int(parts[2]), parts[3])
