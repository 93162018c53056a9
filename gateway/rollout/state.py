"""The rollout's persisted state: phase, weight, generation and the audited history of transitions."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any

from gateway.errors import Conflict

HISTORY_LIMIT = 100  # the state is one Redis value written on every change: keep it bounded


class Phase(StrEnum):
    """Where a rollout stands."""

    HEALTHY = "Healthy"  # nothing in progress: the promotion is complete and the candidate serves all traffic
    PROGRESSING = "Progressing"  # walking the steps: the candidate serves weight_pct, guards are watched
    PAUSED = "Paused"  # holding at weight_pct for a human (manual step, manual pause, or max_hold reached)
    ABORTED = "Aborted"  # rolled back: every request goes to stable and shadows stop until retry
    PROMOTING = "Promoting"  # all steps passed: the candidate takes all traffic; becomes Healthy next tick


class Arm(StrEnum):
    """Which side of a rollout serves a request."""

    CANDIDATE = "candidate"  # served by the candidate target; its samples feed the guards
    CONTROL = "control"  # served by stable, in the concurrent comparison cohort [w, 2w)
    STABLE = "stable"  # served by stable and not measured


class RolloutError(Exception):
    """A manual operation that cannot apply; the admin API maps it to 409."""


class StaleGeneration(Conflict, RolloutError):
    """The caller acted on an older generation of the state than the current one."""

    code = "stale_generation"


class InvalidTransition(Conflict, RolloutError):
    """The operation makes no sense in the current phase (e.g. resume while Progressing)."""

    code = "invalid_transition"


@dataclass(frozen=True, slots=True)
class Transition:
    """One audited change: who (a human or "ticker"), why, and what the state became."""

    at: float
    actor: str
    action: str
    reason: str
    phase: Phase
    step_index: int
    weight_pct: float
    generation: int

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "phase": self.phase.value}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Transition:
        return cls(**{**raw, "phase": Phase(raw["phase"])})


@dataclass(frozen=True, slots=True)
class RolloutState:
    """A rollout's whole state; every change yields a new value with generation + 1 (the store's CAS key)."""

    rollout_id: str  # also the bucketing salt: a new rollout reshuffles, a retry keeps assignments
    phase: Phase
    step_index: int = 0  # the step being executed or waited on; len(steps) once all are done
    weight_pct: float = 0.0
    shadow_pct: float = 0.0
    generation: int = 0
    window: int = 0  # samples are counted per window; a new weight (or a retry) opens a new one
    run: int = 0  # bumped by retry so sessions' recorded arms from an aborted run are not reused
    reasons: tuple[str, ...] = ()
    step_started_at: float = 0.0
    hold_since: float | None = None  # when the end-of-step check first came out Inconclusive
    history: tuple[Transition, ...] = field(default=())

    def moved(self, now: float, actor: str, action: str, reason: str = "", **changes: Any) -> RolloutState:
        """A new state with the changes applied, generation bumped and the transition appended to history."""
        nxt = replace(self, generation=self.generation + 1, **changes)
        entry = Transition(
            now, actor, action, reason, nxt.phase, nxt.step_index, nxt.weight_pct, nxt.generation
        )
        return replace(nxt, history=(*self.history, entry)[-HISTORY_LIMIT:])

    def to_dict(self) -> dict[str, Any]:
        return {
            **{
                k: getattr(self, k)
                for k in self.__dataclass_fields__
                if k not in ("phase", "reasons", "history")
            },
            "phase": self.phase.value,
            "reasons": list(self.reasons),
            "history": [t.to_dict() for t in self.history],
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RolloutState:
        return cls(
            **{
                **raw,
                "phase": Phase(raw["phase"]),
                "reasons": tuple(raw.get("reasons", ())),
                "history": tuple(Transition.from_dict(t) for t in raw.get("history", ())),
            }
        )


def start(rollout_id: str, now: float) -> RolloutState:
    """The state of a rollout the ticker has just found in the policy: step 0, nothing shifted yet."""
    return RolloutState(rollout_id, Phase.PROGRESSING, step_started_at=now).moved(now, "ticker", "start")
