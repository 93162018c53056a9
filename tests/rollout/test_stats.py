"""Exact figures of the tests, and the false-abort rate of the SLO rule under continuous monitoring."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest

from gateway.rollout.stats import (
    Status,
    betainc,
    binomial_lower,
    binomial_tail,
    binomial_upper,
    breaches_slo,
    difference_interval,
    median_interval,
    non_inferiority,
    spent,
    wilson,
    win_share,
)


@pytest.mark.parametrize(("n", "first_abort"), [(10, 4), (20, 5), (100, 11), (1000, 45)])
def test_slo_rule_at_2pct_and_alpha_0_001(n: int, first_abort: int) -> None:
    # A sequential test needs a little more than a one-look test would (3 in 10, 4 in 20, 8 in 100):
    # the price of staying valid however often it is looked at.
    assert breaches_slo(first_abort, n, 0.02, 0.001)
    assert not breaches_slo(first_abort - 1, n, 0.02, 0.001)


def test_slo_rule_needs_samples() -> None:
    assert not breaches_slo(0, 0, 0.02)
    assert not breaches_slo(1, 1, 0.02)  # one failure proves nothing at alpha 0.001
    assert not breaches_slo(2, 2, 0.02)
    assert breaches_slo(3, 3, 0.02)


def _false_aborts(rule: Callable[[int, int], bool], p: float, n_max: int, runs: int) -> float:
    """The share of runs, at a true error rate p, in which `rule(errors, n)` ever fires when it is looked
    at after every single request up to n_max (the rollout's replicas look every 0.1 s)."""
    rng = random.Random(12)
    fired = 0
    for _ in range(runs):
        errors = 0
        for n in range(1, n_max + 1):
            if rng.random() < p:
                errors += 1
                # with the errors fixed, more requests only weaken the evidence: look when one arrives
                if rule(errors, n):
                    fired += 1
                    break
    return fired / runs


def test_the_slo_rule_keeps_its_level_however_often_it_is_looked_at() -> None:
    """Simulated at a true error rate exactly at the SLO (the worst case for a false abort)."""
    slo, alpha, runs = 0.05, 0.05, 1000
    sequential = _false_aborts(lambda k, n: breaches_slo(k, n, slo, alpha), slo, 1000, runs)
    assert sequential <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / runs)
    # A fixed-sample exact test at the same level, looked at as often, aborts several times as often.
    one_look = _false_aborts(lambda k, n: binomial_tail(k, n, slo) < alpha, slo, 1000, runs)
    assert one_look > 3 * alpha


def test_interim_looks_spend_their_level_over_the_sample_counts() -> None:
    assert sum(spent(0.001, n) for n in range(1, 100_000)) == pytest.approx(0.001, rel=1e-4)
    assert spent(0.001, 1) == 0.0005 and spent(0.001, 0) == 0.0005


def test_clopper_pearson_known_values() -> None:
    # Two-sided 95% for 5/10 is (0.1871, 0.8129); one-sided 95% upper for 0/10 is 1 - 0.05**(1/10).
    assert binomial_lower(5, 10, 0.025) == pytest.approx(0.187086, abs=1e-6)
    assert binomial_upper(5, 10, 0.025) == pytest.approx(0.812914, abs=1e-6)
    assert binomial_upper(0, 10, 0.05) == pytest.approx(1 - 0.05**0.1, abs=1e-9)
    assert binomial_lower(10, 10, 0.05) == pytest.approx(0.05**0.1, abs=1e-9)
    assert binomial_lower(0, 10, 0.05) == 0.0 and binomial_upper(10, 10, 0.05) == 1.0


@pytest.mark.parametrize(("k", "n"), [(0, 5), (1, 7), (3, 10), (17, 40), (8, 100), (499, 1000), (3, 100_000)])
@pytest.mark.parametrize("alpha", [0.001, 0.025, 0.05])
def test_clopper_pearson_matches_scipy(k: int, n: int, alpha: float) -> None:
    beta = pytest.importorskip("scipy.stats").beta
    expected_lower = beta.ppf(alpha, k, n - k + 1) if k > 0 else 0.0
    expected_upper = beta.ppf(1 - alpha, k + 1, n - k) if k < n else 1.0
    assert binomial_lower(k, n, alpha) == pytest.approx(expected_lower, rel=1e-7, abs=1e-12)
    assert binomial_upper(k, n, alpha) == pytest.approx(expected_upper, rel=1e-7, abs=1e-12)


def test_binomial_tail_and_betainc() -> None:
    # P(X >= 3 | n=10, p=0.02) = 1 - P(0) - P(1) - P(2)
    p0, p1, p2 = 0.98**10, 10 * 0.02 * 0.98**9, 45 * 0.02**2 * 0.98**8
    assert binomial_tail(3, 10, 0.02) == pytest.approx(1 - p0 - p1 - p2, rel=1e-9)
    assert binomial_tail(0, 10, 0.5) == 1.0 and binomial_tail(11, 10, 0.5) == 0.0
    assert betainc(2, 3, 0.0) == 0.0 and betainc(2, 3, 1.0) == 1.0
    assert betainc(1, 1, 0.3) == pytest.approx(0.3)


def test_wilson_known_value() -> None:
    # 95% two-sided Wilson for 0/10 is (0, 0.2775); for 5/10 (0.2366, 0.7634).
    assert wilson(0, 10, 0.025) == pytest.approx((0.0, 0.27753), abs=1e-5)
    assert wilson(5, 10, 0.025) == pytest.approx((0.23659, 0.76341), abs=1e-5)
    assert wilson(0, 0, 0.025) == (0.0, 1.0)


def test_difference_interval_newcombe() -> None:
    # Newcombe (1998) example: 56/70 vs 48/80 -> 95% (0.0524, 0.3339).
    lower, upper = difference_interval(56, 70, 48, 80, 0.025)
    assert lower == pytest.approx(0.0524, abs=1e-4)
    assert upper == pytest.approx(0.3339, abs=1e-4)


def test_non_inferiority_three_ways() -> None:
    assert non_inferiority("e", 0, 400, 0, 400, 0.02, 0.05).status is Status.PASS
    assert non_inferiority("e", 40, 400, 2, 400, 0.02, 0.05).status is Status.FAIL
    assert non_inferiority("e", 1, 20, 0, 20, 0.02, 0.05).status is Status.INCONCLUSIVE
    interim = non_inferiority("e", 0, 400, 0, 400, 0.02, 0.05, allow_pass=False)
    assert interim.status is Status.INCONCLUSIVE  # interim looks may only abort
    empty = non_inferiority("e", 0, 0, 0, 10, 0.02, 0.05)
    assert empty.status is Status.INCONCLUSIVE and empty.estimate is None


def test_win_share_sign_test() -> None:
    assert win_share("q", 0, 0, 0.05, 0.05).status is Status.INCONCLUSIVE
    assert win_share("q", 60, 40, 0.05, 0.05).status is Status.PASS  # lower bound 0.51 > 0.45
    assert win_share("q", 20, 80, 0.05, 0.05).status is Status.FAIL
    assert win_share("q", 5, 5, 0.05, 0.05).status is Status.INCONCLUSIVE
    v = win_share("q", 60, 40, 0.05, 0.05)
    assert v.n == 100 and v.estimate == 0.6 and v.lower is not None and 0.51 < v.lower < 0.52


def test_median_order_statistic_interval() -> None:
    # Textbook: for n=100 the 95% interval of the median is [x(40), x(61)].
    assert median_interval([float(i) for i in range(1, 101)]) == (50.5, 40.0, 61.0)
    assert median_interval([]) is None
    assert median_interval([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)  # too few for 95%: the whole range
