"""The audited manual operations on a rollout: each checks the generation, then the phase."""

from __future__ import annotations

from gateway.rollout.spec import PauseStep, RolloutSpec, SetWeightStep
from gateway.rollout.state import InvalidTransition, Phase, RolloutState, StaleGeneration


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
