"""The task_success_rate and cost_per_success guards: session-level counters, the tests, step()'s verdicts."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from pydantic import ValidationError

from gateway.rollout.analysis import evaluate
from gateway.rollout.samples import Cohort, Observations, OutcomeSample, outcome_fields
from gateway.rollout.spec import RolloutSpec
from gateway.rollout.state import Phase
from gateway.rollout.stats import Spend, Status, cost_ratio, spent
from gateway.rollout.step import start, step


def _spec(**guards: object) -> RolloutSpec:
    return RolloutSpec.model_validate({
        "id": "r1", "route": "auto", "candidate": "deployment:hq-v2",
        "steps": [{"set_weight": 50}, {"analysis": {"guards": ["task_success_rate", "cost_per_success"]}},
                  {"set_weight": 100}],
        "guards": {"error_rate": None, **guards},
    })


def _observe(counts: Counter[str], cohort: Cohort, successes: int, failures: int, cost_usd: float) -> None:
    for i in range(successes + failures):
        counts.update(outcome_fields(cohort, OutcomeSample(i < successes, cost_usd)))


def _obs(cand: tuple[int, int, float], ctrl: tuple[int, int, float]) -> Observations:
    counts: Counter[str] = Counter()
    _observe(counts, Cohort.CANDIDATE, *cand)
    _observe(counts, Cohort.CONTROL, *ctrl)
    return Observations.from_counts(counts)


def _verdict(spec: RolloutSpec, obs: Observations, metric: str, final: bool = True) -> object:
    return next(v for v in evaluate(spec, obs, final=final, shadow_active=False) if v.metric == metric)


def test_a_replaced_report_takes_its_counts_back() -> None:
    counts: Counter[str] = Counter()
    counts.update(outcome_fields(Cohort.CANDIDATE, OutcomeSample(True, 0.002)))
    counts.update(outcome_fields(Cohort.CANDIDATE, OutcomeSample(True, 0.002), -1))
    counts.update(outcome_fields(Cohort.CANDIDATE, OutcomeSample(False, 0.003)))
    cand = Observations.from_counts(counts).candidate
    assert (cand.outcomes, cand.successes, cand.cost_nusd, cand.success_cost_nusd) == (1, 0, 3_000_000, 0)
    assert cand.cost_sq_uusd2 == 3000**2


def test_guards_parse_with_defaults_and_refuse_nonsense() -> None:
    spec = _spec(task_success_rate={"min_sessions": 10}, cost_per_success={})
    assert spec.guards.task_success_rate is not None and spec.guards.task_success_rate.margin == 0.05
    assert spec.guards.cost_per_success is not None and spec.guards.cost_per_success.max_ratio == 1.1
    with pytest.raises(ValidationError):
        _spec(task_success_rate={"min_sessions": 0})
    with pytest.raises(ValidationError):
        _spec(cost_per_success={"max_ratio": 0})


def test_too_few_sessions_hold_whatever_they_show() -> None:
    spec = _spec(task_success_rate={"min_sessions": 20}, cost_per_success={"min_sessions": 20})
    obs = _obs((0, 19, 0.01), (30, 0, 0.01))  # the candidate fails every run, but 19 < 20
    for metric in ("task_success_rate", "cost_per_success"):
        v = _verdict(spec, obs, metric)
        assert v.status is Status.INCONCLUSIVE and "20 needed" in v.detail  # type: ignore[attr-defined]


def test_task_success_fails_a_candidate_that_succeeds_less_and_passes_an_equal_one() -> None:
    spec = _spec(task_success_rate={"margin": 0.05, "min_sessions": 20})
    worse = _verdict(spec, _obs((20, 20, 0.01), (39, 1, 0.01)), "task_success_rate")
    assert worse.status is Status.FAIL  # type: ignore[attr-defined]
    assert worse.estimate == pytest.approx(0.5 - 39 / 40)  # type: ignore[attr-defined]
    assert worse.upper < -0.05  # type: ignore[attr-defined]  # shown as a success-rate difference
    # interim looks abort too, at their strict spent alpha: on more evidence than the end of the step needs
    assert _verdict(spec, _obs((20, 20, 0.01), (39, 1, 0.01)), "task_success_rate",
                    final=False).status is Status.INCONCLUSIVE  # type: ignore[attr-defined]
    assert _verdict(spec, _obs((50, 50, 0.01), (98, 2, 0.01)), "task_success_rate",
                    final=False).status is Status.FAIL  # type: ignore[attr-defined]
    equal = _obs((100, 0, 0.01), (100, 0, 0.01))
    assert _verdict(spec, equal, "task_success_rate").status is Status.PASS  # type: ignore[attr-defined]
    # an interim look never passes, and spends its alpha over the sessions looked at
    interim = _verdict(spec, equal, "task_success_rate", final=False)
    assert interim.status is Status.INCONCLUSIVE and f"alpha {spent(0.001, 200):g}" in interim.detail  # type: ignore[attr-defined]


def test_cost_ratio_by_hand() -> None:
    # every session costs the same: no spread in cost, only in success
    cand, ctrl = Spend(40, 36, 40 * 0.001, 40 * 1e-6, 36 * 0.001), Spend(40, 36, 40 * 0.002, 40 * 4e-6, 36 * 0.002)
    v = cost_ratio("cost_per_success", cand, ctrl, 1.1, 0.05)
    assert v.estimate == pytest.approx(0.5) and v.status is Status.PASS
    assert v.lower is not None and v.upper is not None and v.lower < 0.5 < v.upper
    # delta method with constant cost: var(log ratio) = (1 - p) / (n p) per cohort
    half = 1.6448536 * math.sqrt(2 * (0.1 / (40 * 0.9)))
    assert v.upper == pytest.approx(0.5 * math.exp(half), rel=1e-4)
    pricier = cost_ratio("cost_per_success", ctrl, cand, 1.1, 0.05)
    assert pricier.status is Status.FAIL and pricier.estimate == pytest.approx(2.0)
    none = cost_ratio("cost_per_success", Spend(5, 0, 0.01, 0.0, 0.0), ctrl, 1.1, 0.05)
    assert none.status is Status.INCONCLUSIVE and "no success" in none.detail


def test_cheaper_per_call_but_dearer_per_solved_task_fails() -> None:
    # half the price per session, but a third of the successes: 1.5x the cost per success
    spec = _spec(cost_per_success={"max_ratio": 1.1, "min_sessions": 20})
    v = _verdict(spec, _obs((100, 200, 0.005), (270, 30, 0.01)), "cost_per_success")
    assert v.status is Status.FAIL and v.estimate == pytest.approx(1.35)  # type: ignore[attr-defined]


def test_step_aborts_on_task_success_and_promotes_a_cheaper_candidate() -> None:
    spec = _spec(task_success_rate={"margin": 0.05, "min_sessions": 20}, cost_per_success={"min_sessions": 20})
    state = step(spec, start("r1", 0.0), Observations(), 1.0)
    assert (state.phase, state.weight_pct) == (Phase.PROGRESSING, 50.0)
    held = step(spec, state, _obs((5, 0, 0.01), (5, 0, 0.01)), 2.0)
    assert held.phase is Phase.PROGRESSING and any("task_success_rate: inconclusive" in r for r in held.reasons)
    aborted = step(spec, held, _obs((15, 25, 0.01), (39, 1, 0.01)), 3.0)
    assert (aborted.phase, aborted.weight_pct) == (Phase.ABORTED, 0.0)
    assert aborted.reasons[0].startswith("task_success_rate:")
    passed = step(spec, state, _obs((60, 0, 0.004), (60, 0, 0.01)), 2.0)
    assert (passed.phase, passed.weight_pct) == (Phase.PROMOTING, 100.0)


def test_repeated_interim_looks_at_an_equal_candidate_rarely_abort() -> None:
    """Sequential validity in simulation: equal success rates, a look after every session, 200 runs."""
    spec = _spec(task_success_rate={"margin": 0.0, "min_sessions": 5})
    rng, aborted = random.Random(5), 0
    for _ in range(200):
        counts: Counter[str] = Counter()
        for i in range(300):
            cohort = Cohort.CANDIDATE if i % 2 else Cohort.CONTROL
            counts.update(outcome_fields(cohort, OutcomeSample(rng.random() < 0.7, 0.01)))
            if i % 10 == 9 and _verdict(spec, Observations.from_counts(counts), "task_success_rate",
                                        final=False).status is Status.FAIL:  # type: ignore[attr-defined]
                aborted += 1
                break
    assert aborted <= 2  # at interim alpha 0.001 spent over the looks: about none in 200
