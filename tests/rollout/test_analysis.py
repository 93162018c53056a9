"""Interim looks: ticking every second must not inflate the false-abort rate of the guards."""

from __future__ import annotations

import math
import random

from gateway.rollout.analysis import evaluate
from gateway.rollout.samples import CohortCounts, Observations
from gateway.rollout.state import Phase
from gateway.rollout.stats import Status
from gateway.rollout.step import start, step
from tests.fixtures.rollout_scripts import spec_of

STEPS = "steps: [{set_weight: 10}, {analysis: {}}]"


def _false_aborts(interim_alpha: float, runs: int, ticks: int, per_tick: int) -> float:
    """The share of runs whose interim error-rate look ever fails, looked at every tick, when the candidate
    is exactly `margin` worse than control: the worst case for a false abort (a Fail needs more)."""
    margin, control_rate = 0.02, 0.04
    spec = spec_of(STEPS, guards={"error_rate": {"slo": 0.5, "margin": margin}}, alpha=0.2,
                   interim_alpha=interim_alpha)
    rng = random.Random(3)
    fired = 0
    for _ in range(runs):
        k1 = k0 = n = 0
        for _ in range(ticks):
            n += per_tick
            k1 += sum(rng.random() < control_rate + margin for _ in range(per_tick))
            k0 += sum(rng.random() < control_rate for _ in range(per_tick))
            obs = Observations(CohortCounts(n, k1), CohortCounts(n, k0))
            if any(v.status is Status.FAIL for v in evaluate(spec, obs, final=False, shadow_active=False)):
                fired += 1
                break
    return fired / runs


def test_interim_looks_every_tick_keep_the_false_abort_rate_at_interim_alpha() -> None:
    alpha, runs = 0.05, 200
    rate = _false_aborts(alpha, runs, ticks=300, per_tick=10)
    assert rate <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / runs)


def _decisions_while_holding(runs: int, max_hold_s: float) -> tuple[float, float]:
    """Drive step() once a second through an analysis step whose candidate is exactly `margin` worse than
    control (neither a pass nor an abort is right there) until it passes, aborts or pauses at max_hold:
    the shares of runs that wrongly passed and wrongly aborted."""
    margin, control_rate, per_tick = 0.02, 0.04, 10
    spec = spec_of(STEPS, guards={"error_rate": {"slo": 0.5, "margin": margin}}, alpha=0.1,
                   interim_alpha=0.01, max_hold_s=max_hold_s)
    rng = random.Random(8)
    passed = aborted = 0
    for _ in range(runs):
        state = step(spec, start(spec.id, 0.0), Observations(), 0.0)  # enters set_weight: the window opens
        k1 = k0 = n = 0
        for tick in range(1, int(max_hold_s) + 10):
            n += per_tick
            k1 += sum(rng.random() < control_rate + margin for _ in range(per_tick))
            k0 += sum(rng.random() < control_rate for _ in range(per_tick))
            state = step(spec, state, Observations(CohortCounts(n, k1), CohortCounts(n, k0)), float(tick))
            if state.phase is Phase.ABORTED:
                aborted += 1
                break
            if state.step_index >= len(spec.steps) or state.phase is not Phase.PROGRESSING:
                passed += state.phase is not Phase.PAUSED
                break
    return passed / runs, aborted / runs


def test_a_step_that_holds_does_not_multiply_its_chances_of_a_wrong_decision() -> None:
    """The end-of-step check at alpha 0.1, re-looked at while holding for up to 10 minutes: its first look
    spends alpha, the later ones alpha/2 together (and interim looks their own 0.01)."""
    runs = 200
    passed, aborted = _decisions_while_holding(runs, max_hold_s=600)
    slack = 3 * math.sqrt(0.15 * 0.85 / runs)
    assert passed <= 0.15 + slack
    assert aborted <= 0.16 + slack
