"""Rollout test helpers: specs from YAML and a driver that ticks step() over scripted observations."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import yaml

from gateway.rollout import RolloutSpec, RolloutState, start, step
from gateway.rollout_samples import Observations, Sample, scripted


def spec_of(text: str, **overrides: Any) -> RolloutSpec:
    raw = {
        "id": "hq-v2-1",
        "candidate": "deployment:hq-v2",
        "stable": "deployment:hq",
        **yaml.safe_load(text),
    }
    raw.update(overrides)
    return RolloutSpec.model_validate(raw)


def samples(n: int, errors: int = 0, **fields: Any) -> list[Sample]:
    return [Sample(error=i < errors, **fields) for i in range(n)]


def healthy(n: int = 300) -> Observations:
    return scripted(samples(n), samples(n))


EMPTY = Observations()


def drive(
    spec: RolloutSpec,
    ticks: Sequence[float],
    observe: Callable[[RolloutState, float], Observations],
    state: RolloutState | None = None,
) -> tuple[RolloutState, list[tuple[float, str, float]]]:
    """Tick step() at the given times; returns the final state and (t, phase, weight) after each tick."""
    state = state or start(spec.id, ticks[0])
    trace: list[tuple[float, str, float]] = []
    for now in ticks:
        state = step(spec, state, observe(state, now), now)
        trace.append((now, state.phase.value, state.weight_pct))
    return state, trace
