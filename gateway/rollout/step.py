"""The rollout state machine: the pure step() a ticker calls; also the import point of the rollout API."""

from __future__ import annotations

import math
from typing import Any

from gateway.rollout.analysis import evaluate, hard_breach
from gateway.rollout.assignment import Assignment, assign, assign_session, bucket, shadow_sampled, sticky_key
from gateway.rollout.operations import abort, pause, promote, promote_full, resume, retry, undo
from gateway.rollout.samples import Observations
from gateway.rollout.spec import AnalysisStep, PauseStep, RolloutSpec, SetWeightStep, ShadowStep, check_route
from gateway.rollout.state import (
    Arm,
    InvalidTransition,
    Phase,
    RolloutError,
    RolloutState,
    StaleGeneration,
    start,
)
from gateway.rollout.stats import Status, Verdict

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
TICK_S = 1.0  # how often the leader calls step() (gateway/experiments/rollouts.py)
HOLD_LOOK_BASE_S = 10.0


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


def _instant(state: RolloutState, current: SetWeightStep | ShadowStep, now: float) -> RolloutState:
    nxt = state.step_index + 1
    if isinstance(current, SetWeightStep):
        weight = current.set_weight
        return _enter(state, nxt, now, f"set_weight {weight:g}", weight_pct=weight, window=state.window + 1)
    percent = current.shadow.percent
    return _enter(state, nxt, now, f"shadow {percent:g}", shadow_pct=percent)


def _advance(spec: RolloutSpec, state: RolloutState, obs: Observations, now: float) -> RolloutState:
    """Apply instant steps (weights, shadows) until a step that waits, then look at that step once."""
    window = state.window
    for _ in range(len(spec.steps) + 1):
        if state.step_index >= len(spec.steps):
            done = {"phase": Phase.PROMOTING, "weight_pct": 100.0, "shadow_pct": 0.0, "reasons": ()}
            return state.moved(now, TICKER, "promote", "steps complete", hold_since=None, **done)
        current = spec.steps[state.step_index]
        if isinstance(current, SetWeightStep | ShadowStep):
            state = _instant(state, current, now)
        elif isinstance(current, PauseStep) and current.pause.manual:
            waiting = (f"step {state.step_index}: waiting for a human (pause: {{}})",)
            return state.moved(now, TICKER, "pause", "manual step", phase=Phase.PAUSED, reasons=waiting)
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
    """A timed pause or analysis: end-of-step check once due; Inconclusive holds, then pauses at max_hold.

    While a step holds, the check looks again only at hold_look()'s few ticks, each at a share of alpha,
    so holding for long does not multiply its chances of a false pass or a false abort.
    """
    if isinstance(current, PauseStep):
        due_at = state.step_started_at + (current.pause.duration_s or 0.0)
        min_samples = current.pause.until.min_samples if current.pause.until else 0
        only, alpha = None, None
    else:
        due_at, min_samples = state.step_started_at, current.analysis.min_samples
        only, alpha = current.analysis.guards, current.analysis.alpha
    if now < due_at:
        return state
    level = alpha if alpha is not None else spec.alpha
    if state.hold_since is not None:
        band = hold_look(now - state.hold_since)
        if band is None:
            return _held(spec, state, now, state.reasons)
        level /= 2 ** (band + 1)
    verdicts = evaluate(spec, obs, final=True, shadow_active=state.shadow_pct > 0, only=only, alpha=level)
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
    return _held(spec, state, now, tuple(waiting))


def hold_look(held_s: float) -> int | None:
    """Whether the end-of-step check looks again at this tick of a hold: its band j >= 1 at the first tick
    past HOLD_LOOK_BASE_S * (2**j - 1) s of holding (10, 30, 70, 150 … s), else None. A look in band j
    tests at alpha / 2**(j+1): however long the step holds, its later looks spend at most alpha / 2."""
    band = int(math.log2(1.0 + held_s / HOLD_LOOK_BASE_S))
    before = int(math.log2(1.0 + max(held_s - TICK_S, 0.0) / HOLD_LOOK_BASE_S))
    return band if band > before else None


def _held(spec: RolloutSpec, state: RolloutState, now: float, waiting: tuple[str, ...]) -> RolloutState:
    """Still inconclusive: keep holding, or pause for a human once max_hold_s has passed."""
    assert state.hold_since is not None
    if now - state.hold_since >= spec.max_hold_s:
        reasons = (f"inconclusive for {spec.max_hold_s:g} s (max_hold_s)", *waiting)
        return state.moved(now, TICKER, "pause", reasons[0], phase=Phase.PAUSED, reasons=reasons)
    return state


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
