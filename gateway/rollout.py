"""The rollout state machine: the pure step() the ticker calls and the audited manual operations."""

from __future__ import annotations

from typing import Any

from gateway.rollout_analysis import evaluate, hard_breach
from gateway.rollout_assignment import Assignment, assign, assign_session, bucket, shadow_sampled, sticky_key
from gateway.rollout_samples import Observations
from gateway.rollout_spec import AnalysisStep, PauseStep, RolloutSpec, SetWeightStep, ShadowStep, check_route
from gateway.rollout_state import (
    Arm,
    InvalidTransition,
    Phase,
    RolloutError,
    RolloutState,
    StaleGeneration,
    start,
)
from gateway.stats import Status, Verdict

__all__ = [
    "Arm",
    "Assignment",
    "InvalidTransition",
    "Phase",
    "RolloutError",
    "RolloutSpec",
    "RolloutState",
    "StaleGeneration",
    "abort",
    "assign",
    "assign_session",
    "bucket",
    "check_route",
    "pause",
    "promote",
    "promote_full",
    "resume",
    "retry",
    "shadow_sampled",
    "start",
    "status",
    "step",
    "sticky_key",
    "undo",
]

TICKER = "ticker"


def step(spec: RolloutSpec, state: RolloutState, obs: Observations, now: float) -> RolloutState:
    """Advance one tick; returns `state` itself (same generation) when nothing changed."""
    if state.rollout_id != spec.id:
        raise ValueError(f"state of rollout {state.rollout_id!r} stepped with spec {spec.id!r}")
    if state.phase is Phase.PROMOTING:
        return state.moved(now, TICKER, "promoted", "all steps passed", phase=Phase.HEALTHY, reasons=())
    if state.phase not in (Phase.PROGRESSING, Phase.PAUSED):
        return state
    if state.weight_pct > 0:
        breach = hard_breach(spec.guards, obs.candidate, spec.interim_alpha)
        failed = (
            [breach]
            if breach
            else [
                v
                for v in evaluate(spec, obs, final=False, shadow_active=state.shadow_pct > 0)
                if v.status is Status.FAIL
            ]
        )
        if failed:
            return _aborted(state, now, TICKER, "guard failed", failed)
    if state.phase is Phase.PAUSED:
        return state
    return _advance(spec, state, obs, now)


def _aborted(state: RolloutState, now: float, actor: str, reason: str, failed: list[Verdict]) -> RolloutState:
    reasons = tuple(f"{v.metric}: {v.detail}" for v in failed) or (reason,)
    return state.moved(
        now,
        actor,
        "abort",
        "; ".join(reasons),
        phase=Phase.ABORTED,
        weight_pct=0.0,
        shadow_pct=0.0,
        reasons=reasons,
        hold_since=None,
    )


def _enter(state: RolloutState, index: int, now: float, action: str, **changes: Any) -> RolloutState:
    return state.moved(
        now, TICKER, action, "", step_index=index, step_started_at=now, hold_since=None, **changes
    )


def _advance(spec: RolloutSpec, state: RolloutState, obs: Observations, now: float) -> RolloutState:
    """Apply instant steps (weights, shadows) until a step that waits, then look at that step once."""
    window = state.window
    for _ in range(len(spec.steps) + 1):
        if state.step_index >= len(spec.steps):
            return state.moved(
                now,
                TICKER,
                "promote",
                "steps complete",
                phase=Phase.PROMOTING,
                weight_pct=100.0,
                shadow_pct=0.0,
                reasons=(),
                hold_since=None,
            )
        current = spec.steps[state.step_index]
        nxt = state.step_index + 1
        if isinstance(current, SetWeightStep):
            state = _enter(
                state,
                nxt,
                now,
                f"set_weight {current.set_weight:g}",
                weight_pct=current.set_weight,
                window=state.window + 1,
            )
        elif isinstance(current, ShadowStep):
            state = _enter(
                state, nxt, now, f"shadow {current.shadow.percent:g}", shadow_pct=current.shadow.percent
            )
        elif isinstance(current, PauseStep) and current.pause.manual:
            return state.moved(
                now,
                TICKER,
                "pause",
                "manual step",
                phase=Phase.PAUSED,
                reasons=(f"step {state.step_index}: waiting for a human (pause: {{}})",),
            )
        elif state.window != window:
            return state  # obs belong to the previous window; the new one is first looked at next tick
        else:
            waited = _wait(spec, state, obs, now, current)
            if waited.step_index == state.step_index or waited.phase is not Phase.PROGRESSING:
                return waited
            state = waited
    return state


def _wait(
    spec: RolloutSpec, state: RolloutState, obs: Observations, now: float, current: PauseStep | AnalysisStep
) -> RolloutState:
    """A timed pause or analysis: end-of-step check once due; Inconclusive holds, then pauses at max_hold."""
    if isinstance(current, PauseStep):
        due_at = state.step_started_at + (current.pause.duration_s or 0.0)
        min_samples = current.pause.until.min_samples if current.pause.until else 0
        only, alpha = None, None
    else:
        due_at, min_samples = state.step_started_at, current.analysis.min_samples
        only, alpha = current.analysis.guards, current.analysis.alpha
    if now < due_at:
        return state
    verdicts = evaluate(spec, obs, final=True, shadow_active=state.shadow_pct > 0, only=only, alpha=alpha)
    failed = [v for v in verdicts if v.status is Status.FAIL]
    if failed:
        return _aborted(state, now, TICKER, "end-of-step check failed", failed)
    waiting = [
        f"{v.metric}: inconclusive (n={v.n}; {v.detail})" for v in verdicts if v.status is not Status.PASS
    ]
    if obs.candidate.requests < min_samples:
        waiting.insert(0, f"samples: {obs.candidate.requests} of {min_samples} candidate requests")
    if not waiting:
        return _enter(state, state.step_index + 1, now, "step passed")
    if state.hold_since is None:
        return state.moved(now, TICKER, "hold", "; ".join(waiting), hold_since=now, reasons=tuple(waiting))
    if now - state.hold_since >= spec.max_hold_s:
        reasons = (f"inconclusive for {spec.max_hold_s:g} s (max_hold_s)", *waiting)
        return state.moved(now, TICKER, "pause", reasons[0], phase=Phase.PAUSED, reasons=reasons)
    return state


# Manual operations: each checks the caller's generation, then the phase, then records actor and reason.


def _guard(state: RolloutState, generation: int, action: str, allowed: tuple[Phase, ...]) -> None:
    if generation != state.generation:
        raise StaleGeneration(
            f"{action}: generation {generation} is stale, the rollout is at generation {state.generation}"
        )
    if state.phase not in allowed:
        names = ", ".join(p.value for p in allowed)
        raise InvalidTransition(f"{action}: not possible while {state.phase.value} (only while {names})")


_LIVE = (Phase.PROGRESSING, Phase.PAUSED)


def pause(state: RolloutState, *, actor: str, reason: str, generation: int, now: float) -> RolloutState:
    """Hold at the current weight until resumed; guards keep watching and may still abort."""
    _guard(state, generation, "pause", (Phase.PROGRESSING,))
    return state.moved(
        now, actor, "pause", reason, phase=Phase.PAUSED, reasons=(f"paused by {actor}: {reason}",)
    )


def resume(
    spec: RolloutSpec, state: RolloutState, *, actor: str, reason: str, generation: int, now: float
) -> RolloutState:
    """Continue from a pause: a manual `pause: {}` step is completed, a held step gets a fresh max_hold."""
    _guard(state, generation, "resume", (Phase.PAUSED,))
    index = state.step_index
    if index < len(spec.steps):
        current = spec.steps[index]
        if isinstance(current, PauseStep) and current.pause.manual:
            index += 1
    return state.moved(
        now,
        actor,
        "resume",
        reason,
        phase=Phase.PROGRESSING,
        step_index=index,
        reasons=(),
        hold_since=None,
        step_started_at=now if index != state.step_index else state.step_started_at,
    )


def promote(
    spec: RolloutSpec, state: RolloutState, *, actor: str, reason: str, generation: int, now: float
) -> RolloutState:
    """Skip the current step's wait (or pause); the next tick applies the following steps."""
    _guard(state, generation, "promote", _LIVE)
    index = min(state.step_index + 1, len(spec.steps))
    return state.moved(
        now,
        actor,
        "promote",
        reason,
        phase=Phase.PROGRESSING,
        step_index=index,
        reasons=(),
        hold_since=None,
        step_started_at=now,
    )


def promote_full(
    spec: RolloutSpec, state: RolloutState, *, actor: str, reason: str, generation: int, now: float
) -> RolloutState:
    """Skip every remaining step: the candidate takes all traffic now."""
    _guard(state, generation, "promote_full", _LIVE)
    return state.moved(
        now,
        actor,
        "promote_full",
        reason,
        phase=Phase.PROMOTING,
        step_index=len(spec.steps),
        weight_pct=100.0,
        shadow_pct=0.0,
        reasons=(),
        hold_since=None,
    )


def abort(state: RolloutState, *, actor: str, reason: str, generation: int, now: float) -> RolloutState:
    """Send every request back to stable and stop shadows."""
    _guard(state, generation, "abort", (*_LIVE, Phase.PROMOTING))
    return state.moved(
        now,
        actor,
        "abort",
        reason,
        phase=Phase.ABORTED,
        weight_pct=0.0,
        shadow_pct=0.0,
        reasons=(f"aborted by {actor}: {reason}",),
        hold_since=None,
    )


def retry(state: RolloutState, *, actor: str, reason: str, generation: int, now: float) -> RolloutState:
    """Start an aborted rollout again from step 0 with the same salt, so keys land in the same buckets."""
    _guard(state, generation, "retry", (Phase.ABORTED,))
    return state.moved(
        now,
        actor,
        "retry",
        reason,
        phase=Phase.PROGRESSING,
        step_index=0,
        weight_pct=0.0,
        window=state.window + 1,
        run=state.run + 1,
        reasons=(),
        hold_since=None,
        step_started_at=now,
    )


def undo(
    spec: RolloutSpec, state: RolloutState, *, actor: str, reason: str, generation: int, now: float
) -> RolloutState:
    """Go back to the previous set_weight step's weight (0 if none) and pause there for a human."""
    _guard(state, generation, "undo", (*_LIVE, Phase.PROMOTING, Phase.HEALTHY))
    weights = [
        (i, s.set_weight)
        for i, s in enumerate(spec.steps[: state.step_index])
        if isinstance(s, SetWeightStep)
    ]
    lower = [(i, w) for i, w in weights if w < state.weight_pct]
    index, weight = (lower[-1][0] + 1, lower[-1][1]) if lower else (0, 0.0)
    return state.moved(
        now,
        actor,
        "undo",
        reason,
        phase=Phase.PAUSED,
        step_index=index,
        weight_pct=weight,
        window=state.window + 1,
        reasons=(f"undone by {actor} to weight {weight:g}: {reason}",),
        hold_since=None,
        step_started_at=now,
    )


def status(spec: RolloutSpec, state: RolloutState, obs: Observations, now: float) -> dict[str, Any]:
    """What GET /admin/rollouts/{route} returns: the state plus per-metric n, estimate, interval, verdict."""
    verdicts = evaluate(spec, obs, final=True, shadow_active=state.shadow_pct > 0)
    current = spec.steps[state.step_index] if state.step_index < len(spec.steps) else None
    return {
        "rollout_id": state.rollout_id,
        "candidate": spec.candidate,
        "stable": spec.stable,
        "phase": state.phase.value,
        "step_index": state.step_index,
        "step_count": len(spec.steps),
        "step": current.model_dump(exclude_none=True) if current is not None else None,
        "weight_pct": state.weight_pct,
        "shadow_pct": state.shadow_pct,
        "generation": state.generation,
        "reasons": list(state.reasons),
        "step_age_s": round(now - state.step_started_at, 3),
        "hold_s": None if state.hold_since is None else round(now - state.hold_since, 3),
        "max_hold_s": spec.max_hold_s,
        "samples": {"candidate": obs.candidate.requests, "control": obs.control.requests},
        "metrics": [v.to_dict() for v in verdicts],
    }
