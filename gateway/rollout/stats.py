"""The tests that turn counts into Pass / Fail / Inconclusive verdicts with intervals.

The SLO rule is a sequential test valid however often it is looked at (breaches_slo); the comparisons
with control use Newcombe's and Wilson's score intervals (approximations, sound at small n) and the win
share an exact Clopper-Pearson interval, each at the level it is given per look (see rollout/analysis.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from statistics import NormalDist
from typing import Any

# The rollout's two significance levels: interim looks may only abort, at a strict overall level spent
# over the looks (spent(), breaches_slo()), so looking every tick does not inflate the false-abort rate;
# the end-of-step check uses the normal level.
INTERIM_ALPHA = 0.001
FINAL_ALPHA = 0.05


class Status(StrEnum):
    """The outcome of one guard check."""

    PASS = "pass"  # the data show the candidate is within the threshold
    FAIL = "fail"  # the data show the candidate breaches the threshold
    INCONCLUSIVE = "inconclusive"  # not enough data either way: hold, never pass, never fail


@dataclass(frozen=True, slots=True)
class Verdict:
    """One metric's verdict as status output shows it: samples, estimate, interval, status."""

    metric: str
    status: Status
    n: int
    estimate: float | None
    lower: float | None
    upper: float | None
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "status": self.status.value,
            "n": self.n,
            "estimate": self.estimate,
            "interval": [self.lower, self.upper],
            "detail": self.detail,
        }


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta (modified Lentz), converges fast for x < (a+1)/(a+b+2)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        for aa in (
            m * (b - m) * x / ((qam + m2) * (a + m2)),
            -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2)),
        ):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    return betainc(k, n - k + 1, p)


def _beta_ppf(q: float, a: float, b: float) -> float:
    """The q-quantile of Beta(a, b) by bisection on the incomplete beta (monotone in x)."""
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2.0
        if betainc(a, b, mid) < q:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return (lo + hi) / 2.0


def binomial_lower(k: int, n: int, alpha: float) -> float:
    """One-sided exact (Clopper-Pearson) lower bound of a proportion at level alpha."""
    if n <= 0 or k <= 0:
        return 0.0
    return _beta_ppf(alpha, k, n - k + 1)


def binomial_upper(k: int, n: int, alpha: float) -> float:
    """One-sided exact (Clopper-Pearson) upper bound of a proportion at level alpha."""
    if n <= 0 or k >= n:
        return 1.0
    return _beta_ppf(1.0 - alpha, k + 1, n - k)


def spent(alpha: float, n: int) -> float:
    """The level of an interim look at n samples: alpha / (n (n + 1)), which sums to alpha over every n.

    A Bonferroni spending over sample counts: counts only grow, so looks at distinct counts are distinct
    tests and looks at the same counts repeat one verdict. However often a guard is looked at, every
    tick or every request, its interim false-abort rate stays at most alpha.
    """
    return alpha / (max(n, 1) * (max(n, 1) + 1))


def slo_evidence(errors: int, n: int, slo: float) -> float:
    """log of the mixture likelihood ratio against "error rate <= slo" (a uniform prior on [slo, 1]).

    Under any error rate <= slo it is a nonnegative supermartingale in the samples, so by Ville's
    inequality it ever reaches log(1/alpha) with probability at most alpha: an anytime-valid test,
    however often (and by however many replicas) the running counts are looked at. Exact binomial
    likelihood; no normal approximation.
    """
    if errors <= 0 or n <= 0 or slo <= 0.0:
        return -math.inf
    above = 1.0 - betainc(errors + 1, n - errors + 1, slo)  # the prior's mass of the posterior above slo
    if above <= 0.0:
        return -math.inf
    log_beta = math.lgamma(errors + 1) + math.lgamma(n - errors + 1) - math.lgamma(n + 2)
    return log_beta + math.log(above) - math.log1p(-slo) - errors * math.log(slo) - (n - errors) * math.log1p(-slo)


def breaches_slo(errors: int, n: int, slo: float, alpha: float = INTERIM_ALPHA) -> bool:
    """True when the running counts prove the error rate above the SLO (the hard-abort rule).

    A sequential test (slo_evidence), valid under continuous monitoring: looking after every request on
    every replica keeps the false-abort rate at most alpha. A fixed-sample test looked at that often
    would not (at alpha 0.01 and a 2% SLO, checked after each of 2,000 requests: about 9% false aborts).
    """
    return slo_evidence(errors, n, slo) >= math.log(1.0 / alpha)


def _z(alpha: float) -> float:
    return NormalDist().inv_cdf(1.0 - alpha)


def wilson(k: int, n: int, alpha: float) -> tuple[float, float]:
    """Wilson score interval with alpha in each tail (two-sided level 1 - 2 alpha)."""
    if n <= 0:
        return 0.0, 1.0
    z = _z(alpha)
    p = k / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def difference_interval(k1: int, n1: int, k0: int, n0: int, alpha: float) -> tuple[float, float]:
    """Newcombe's hybrid score bounds of p1 - p0, alpha in each tail; sound at small n unlike Wald's."""
    p1, p0 = k1 / n1, k0 / n0
    l1, u1 = wilson(k1, n1, alpha)
    l0, u0 = wilson(k0, n0, alpha)
    d = p1 - p0
    lower = d - math.sqrt((p1 - l1) ** 2 + (u0 - p0) ** 2)
    upper = d + math.sqrt((u1 - p1) ** 2 + (p0 - l0) ** 2)
    return max(-1.0, lower), min(1.0, upper)


def non_inferiority(
    metric: str, k1: int, n1: int, k0: int, n0: int, margin: float, alpha: float, *, allow_pass: bool = True
) -> Verdict:
    """Candidate rate k1/n1 (higher is worse) against control k0/n0 with an absolute margin.

    Pass when the upper bound of the difference is below the margin (non-inferiority shown); Fail when
    the lower bound is above it (inferiority shown); otherwise Inconclusive. Interim looks pass
    allow_pass=False: they may only abort.
    """
    if n1 == 0 or n0 == 0:
        return Verdict(metric, Status.INCONCLUSIVE, n1, None, None, None, f"no samples (control n={n0})")
    lower, upper = difference_interval(k1, n1, k0, n0, alpha)
    estimate = k1 / n1 - k0 / n0
    detail = f"candidate {k1}/{n1} vs control {k0}/{n0}, margin {margin:g}, alpha {alpha:g}"
    if lower > margin:
        status = Status.FAIL
    elif upper < margin and allow_pass:
        status = Status.PASS
    else:
        status = Status.INCONCLUSIVE
    return Verdict(metric, status, n1, estimate, lower, upper, detail)


def win_share(
    metric: str, wins: int, losses: int, margin: float, alpha: float, *, allow_pass: bool = True
) -> Verdict:
    """Paired sign test of the candidate's win share (ties dropped) against 0.5 - margin."""
    n = wins + losses
    floor = 0.5 - margin
    if n == 0:
        return Verdict(metric, Status.INCONCLUSIVE, 0, None, None, None, "no decided pairs")
    lower, upper = binomial_lower(wins, n, alpha), binomial_upper(wins, n, alpha)
    if upper < floor:
        status = Status.FAIL
    elif lower > floor and allow_pass:
        status = Status.PASS
    else:
        status = Status.INCONCLUSIVE
    detail = f"{wins} wins / {losses} losses, floor {floor:g}, alpha {alpha:g}"
    return Verdict(metric, status, n, wins / n, lower, upper, detail)


def median_interval(values: Sequence[float], alpha: float = 0.025) -> tuple[float, float, float] | None:
    """Median with a distribution-free order-statistic interval (alpha in each tail); None if empty."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        return None
    median = xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2.0
    # Largest j with P(Binomial(n, 1/2) < j) <= alpha: then [x_(j), x_(n+1-j)] covers the median.
    j = 0
    while j + 1 <= n and 1.0 - binomial_tail(j + 1, n, 0.5) <= alpha:
        j += 1
    if j == 0:
        return median, xs[0], xs[-1]
    return median, xs[j - 1], xs[n - j]


@dataclass(frozen=True, slots=True)
class Spend:
    """A cohort's sessions with an outcome: how many, their successes, and sums of their cost (USD), of its
    square (USD^2) and of the successes' cost: the moments the cost-per-success test needs."""

    sessions: int
    successes: int
    cost: float
    cost_sq: float
    success_cost: float

    @property
    def per_success(self) -> float | None:
        return self.cost / self.successes if self.successes else None

    def log_variance(self) -> float:
        """The delta-method variance of log(mean cost / mean success) over the cohort's sessions."""
        n = self.sessions
        mc, ms = self.cost / n, self.successes / n
        var_c = max(0.0, self.cost_sq / n - mc * mc)
        var_s = ms * (1.0 - ms)
        cov = self.success_cost / n - mc * ms
        return max(0.0, var_c / (mc * mc) + var_s / (ms * ms) - 2.0 * cov / (mc * ms)) / n


def cost_ratio(
    metric: str, candidate: Spend, control: Spend, max_ratio: float, alpha: float, *, allow_pass: bool = True
) -> Verdict:
    """The candidate's cost per success over control's (higher is worse) against max_ratio.

    The log of the ratio of two ratio estimators (cost / successes per cohort), its interval by the delta
    method: Pass when the upper bound is below log(max_ratio), Fail when the lower bound is above it,
    otherwise Inconclusive; so is a cohort without a success or without spend.
    """
    n1, n0 = candidate.sessions, control.sessions
    r1, r0 = candidate.per_success, control.per_success
    detail = (f"candidate {_usd(r1)} per success ({candidate.successes}/{n1}) vs control {_usd(r0)} "
              f"({control.successes}/{n0}), max ratio {max_ratio:g}, alpha {alpha:g}")
    if not r1 or not r0:
        return Verdict(metric, Status.INCONCLUSIVE, n1, None, None, None, detail + ": no success or no spend yet")
    d = math.log(r1 / r0)
    half = _z(alpha) * math.sqrt(candidate.log_variance() + control.log_variance())
    limit = math.log(max_ratio)
    if d - half > limit:
        status = Status.FAIL
    elif d + half < limit and allow_pass:
        status = Status.PASS
    else:
        status = Status.INCONCLUSIVE
    return Verdict(metric, status, n1, math.exp(d), math.exp(d - half), math.exp(d + half), detail)


def _usd(value: float | None) -> str:
    return "-" if value is None else f"${value:.6g}"
