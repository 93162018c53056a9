"""Guard analysis: turns one rollout window's cohort counters into per-metric verdicts."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from gateway.rollout.samples import MICRO_USD, NANO_USD, CohortCounts, Observations, PairOutcome, bin_upper_ms
from gateway.rollout.spec import CostPerSuccessGuard, Guards, LatencyGuard, RolloutSpec, TaskSuccessGuard
from gateway.rollout.stats import (
    Spend,
    Status,
    Verdict,
    binomial_lower,
    binomial_upper,
    breaches_slo,
    cost_ratio,
    non_inferiority,
    spent,
    win_share,
)

GUARD_NAMES = ("error_rate", "ttft_p95", "tpot_p95", "shadow_quality", "tool_error_rate", "rework_rate",
               "task_success_rate", "cost_per_success")


def hard_breach(guards: Guards, candidate: CohortCounts, alpha: float) -> Verdict | None:
    """The SLO rule that aborts even on a handful of samples: a Fail verdict, or None."""
    if guards.error_rate is None:
        return None
    k, n, slo = candidate.errors, candidate.requests, guards.error_rate.slo
    if not breaches_slo(k, n, slo, alpha):
        return None
    detail = (f"{k} errors in {n} requests: above the {slo:g} SLO by a sequential test at alpha {alpha:g} "
              "(valid however often it is looked at)")
    return Verdict(
        "error_rate_slo",
        Status.FAIL,
        n,
        k / n,
        binomial_lower(k, n, alpha),
        binomial_upper(k, n, alpha),
        detail,
    )


def _p95_bin(control: Counter[int]) -> int:
    n0 = sum(control.values())
    cumulative = 0
    for index in sorted(control):
        cumulative += control[index]
        if cumulative >= 0.95 * n0:
            return index
    return max(control)


def _exceedances(
    strata: Iterable[tuple[Counter[int], Counter[int]]], min_control: int
) -> tuple[int, int, int, int, list[float]]:
    """Pooled (k1, n1, k0, n0) of requests above control's p95, stratum by stratum, plus the p95s used."""
    k1 = n1 = k0 = n0 = 0
    thresholds: list[float] = []
    for cand, ctrl in strata:
        if sum(ctrl.values()) < min_control:
            continue  # control's p95 is not yet trustworthy here; these candidate samples wait
        edge = _p95_bin(ctrl)
        thresholds.append(bin_upper_ms(edge))
        k1 += sum(c for b, c in cand.items() if b > edge)
        n1 += sum(cand.values())
        k0 += sum(c for b, c in ctrl.items() if b > edge)
        n0 += sum(ctrl.values())
    return k1, n1, k0, n0, thresholds


def _latency(
    name: str, guard: LatencyGuard, strata: list[tuple[Counter[int], Counter[int]]], alpha: float, final: bool
) -> Verdict:
    k1, n1, k0, n0, thresholds = _exceedances(strata, guard.min_control_samples)
    level = alpha if final else spent(alpha, n1 + n0)
    verdict = non_inferiority(name, k1, n1, k0, n0, guard.margin, level, allow_pass=final)
    p95s = ", ".join(f"{t:.0f}" for t in thresholds) or "none yet"
    return Verdict(
        name,
        verdict.status,
        verdict.n,
        verdict.estimate,
        verdict.lower,
        verdict.upper,
        f"share above control p95 (ms: {p95s}); {verdict.detail}",
    )


def _too_few(metric: str, cand: CohortCounts, ctrl: CohortCounts, min_sessions: int) -> Verdict | None:
    """Inconclusive below min_sessions sessions with an outcome in either cohort (never a pass or a fail)."""
    if cand.outcomes >= min_sessions and ctrl.outcomes >= min_sessions:
        return None
    return Verdict(metric, Status.INCONCLUSIVE, cand.outcomes, None, None, None,
                   f"{cand.outcomes} candidate and {ctrl.outcomes} control sessions with an outcome, "
                   f"{min_sessions} needed in each")


def _task_success(guard: TaskSuccessGuard, cand: CohortCounts, ctrl: CohortCounts, level: float,
                  final: bool) -> Verdict:
    """Failures per session (higher is worse) by the error-rate guard's test, shown as the success rates'
    difference (candidate minus control): Fail when the candidate's is shown more than `margin` below."""
    few = _too_few("task_success_rate", cand, ctrl, guard.min_sessions)
    if few is not None:
        return few
    at = level if final else spent(level, cand.outcomes + ctrl.outcomes)
    failures = non_inferiority("task_success_rate", cand.outcomes - cand.successes, cand.outcomes,
                               ctrl.outcomes - ctrl.successes, ctrl.outcomes, guard.margin, at, allow_pass=final)
    assert failures.estimate is not None and failures.lower is not None and failures.upper is not None
    detail = (f"candidate {cand.successes}/{cand.outcomes} succeeded vs control {ctrl.successes}/{ctrl.outcomes}, "
              f"margin {guard.margin:g}, alpha {at:g}")
    return Verdict("task_success_rate", failures.status, failures.n, -failures.estimate, -failures.upper,
                   -failures.lower, detail)


def _spend(counts: CohortCounts) -> Spend:
    return Spend(counts.outcomes, counts.successes, counts.cost_nusd / NANO_USD,
                 counts.cost_sq_uusd2 / MICRO_USD**2, counts.success_cost_nusd / NANO_USD)


def _cost_per_success(guard: CostPerSuccessGuard, cand: CohortCounts, ctrl: CohortCounts, level: float,
                      final: bool) -> Verdict:
    few = _too_few("cost_per_success", cand, ctrl, guard.min_sessions)
    if few is not None:
        return few
    at = level if final else spent(level, cand.outcomes + ctrl.outcomes)
    return cost_ratio("cost_per_success", _spend(cand), _spend(ctrl), guard.max_ratio, at, allow_pass=final)


def evaluate(
    spec: RolloutSpec,
    obs: Observations,
    *,
    final: bool,
    shadow_active: bool,
    only: Iterable[str] | None = None,
    alpha: float | None = None,
) -> tuple[Verdict, ...]:
    """Every configured guard's verdict; interim looks (final=False) never Pass and spend interim_alpha
    over the sample counts looked at (stats.spent), so ticking every second does not inflate it."""
    level = alpha if alpha is not None else (spec.alpha if final else spec.interim_alpha)
    wanted = set(only) if only is not None else set(GUARD_NAMES)
    guards, cand, ctrl = spec.guards, obs.candidate, obs.control
    verdicts: list[Verdict] = []
    if guards.error_rate is not None and "error_rate" in wanted:
        breach = hard_breach(guards, cand, spec.interim_alpha)
        counts = (cand.errors, cand.requests, ctrl.errors, ctrl.requests)
        margin = guards.error_rate.margin
        at = level if final else spent(level, cand.requests + ctrl.requests)
        verdicts.append(breach or non_inferiority("error_rate", *counts, margin, at, allow_pass=final))
    if guards.ttft_p95 is not None and "ttft_p95" in wanted:
        strata = [
            (cand.ttft.get(s, Counter()), ctrl.ttft.get(s, Counter()))
            for s in sorted(set(cand.ttft) | set(ctrl.ttft))
        ]
        verdicts.append(_latency("ttft_p95", guards.ttft_p95, strata, level, final))
    if guards.tpot_p95 is not None and "tpot_p95" in wanted:
        verdicts.append(_latency("tpot_p95", guards.tpot_p95, [(cand.tpot, ctrl.tpot)], level, final))
    if guards.tool_error_rate is not None and "tool_error_rate" in wanted:
        counts = (cand.tool_errors, cand.tool_results, ctrl.tool_errors, ctrl.tool_results)
        margin = guards.tool_error_rate.margin
        verdicts.append(non_inferiority("tool_error_rate", *counts, margin, level, allow_pass=final))
    if guards.rework_rate is not None and "rework_rate" in wanted:
        counts = (cand.rework, cand.tool_steps, ctrl.rework, ctrl.tool_steps)
        verdicts.append(non_inferiority("rework_rate", *counts, guards.rework_rate.margin, level, allow_pass=final))
    if guards.task_success_rate is not None and "task_success_rate" in wanted:
        verdicts.append(_task_success(guards.task_success_rate, cand, ctrl, level, final))
    if guards.cost_per_success is not None and "cost_per_success" in wanted:
        verdicts.append(_cost_per_success(guards.cost_per_success, cand, ctrl, level, final))
    if guards.shadow_quality is not None and "shadow_quality" in wanted and shadow_active:
        wins, losses = obs.pairs[PairOutcome.WIN], obs.pairs[PairOutcome.LOSS]
        at = level if final else spent(level, wins + losses)
        verdicts.append(
            win_share("shadow_quality", wins, losses, guards.shadow_quality.margin, at, allow_pass=final)
        )
    return tuple(verdicts)
