"""The live share tracker: exact top-share thresholds, cold start, a window that follows the mix."""

from __future__ import annotations

import random

import numpy as np
import pytest

from gateway.decision.share import MIN_SAMPLES, STEP_IQR, RouteScores, ShareTracker, top_share_threshold
from gateway.policy import model as policy


def _policy(share: float = 0.2, window: int = 400, threshold: float = 0.5) -> policy.Policy:
    return policy.parse(f"""
version: 1
deployments:
  hq: {{url: "http://127.0.0.1:1", served_model: a}}
  fast: {{url: "http://127.0.0.1:2", served_model: b}}
models: {{auto: {{route: rules}}, hq: {{pin: hq}}}}
rules:
  - name: hard
    when: {{complexity: {{hq_share: {share}, window: {window}, threshold: {threshold}}}}}
    use: hq
default: fast
""")


@pytest.mark.parametrize("share", [0.01, 0.2, 0.5, 0.99])
def test_the_threshold_puts_exactly_the_top_share_at_or_above_it(share: float) -> None:
    scores = np.random.default_rng(1).random(1000)
    t = top_share_threshold(sorted(scores.tolist()), share)
    assert int((scores >= t).sum()) == int(np.ceil(share * 1000))


def test_cold_start_until_enough_calls_then_live() -> None:
    tracker = ShareTracker()
    tracker.follow(_policy())
    for i in range(MIN_SAMPLES - 1):
        assert tracker.observe("auto", i / 1000) == {0.2: 0.5}
    for _ in range(64):
        tracker.observe("auto", 0.01)
    (described,) = tracker.describe("auto").values()
    assert described["source"] == "live" and described["threshold"] < 0.5


def test_observed_share_follows_the_target_across_two_mixes() -> None:
    rng = random.Random(3)
    tracker = ShareTracker()
    tracker.follow(_policy())
    for mix in (lambda: rng.random() * 0.1, lambda: 0.6 + rng.random() * 0.4):
        for _ in range(500):  # warm-up: the window (400) is all this mix afterwards
            tracker.observe("auto", mix())
        hits = 0
        for _ in range(1000):
            score = mix()
            hits += score >= tracker.observe("auto", score)[0.2]
        assert hits / 1000 == pytest.approx(0.2, abs=0.03)
    observed = tracker.describe("auto")["0.2"]["observed"]
    assert observed == pytest.approx(0.2, abs=0.03)


def test_a_reload_that_keeps_the_window_keeps_the_scores() -> None:
    tracker = ShareTracker()
    tracker.follow(_policy(share=0.2))
    for i in range(300):
        tracker.observe("auto", i / 300)
    tracker.follow(_policy(share=0.3))
    assert tracker.describe("auto")["0.3"]["samples"] == 300
    assert tracker.thresholds("auto")[0.3] == pytest.approx(0.7, abs=0.01)


def test_routes_are_apart_and_a_replica_takes_the_fleet_window() -> None:
    tracker = ShareTracker(shared=True)
    tracker.follow(_policy())
    for i in range(10):  # too few of its own to leave the cold start
        tracker.observe("auto", i / 100)
    route = tracker.routes["auto"]
    assert len(route.pending) == 10 and "other" not in tracker.routes
    route.replace([0.9] * 50 + [0.1] * 200)  # the fleet's window, as the store answers it
    assert tracker.thresholds("auto")[0.2] == pytest.approx(0.9)
    assert tracker.describe("auto")["0.2"]["source"] == "live"


def test_the_served_share_cannot_drift_off_target() -> None:
    """Robbins-Monro: over n calls the served share is X + (threshold drift) / (step * n)."""
    rng = random.Random(8)
    tracker = ShareTracker()
    tracker.follow(_policy(window=200))
    hits = 0
    for i in range(5000):
        score = rng.betavariate(2, 5) if i % 2 else rng.random()  # a lumpy mix
        hits += score >= tracker.observe("auto", score)[0.2]
    assert hits / 5000 == pytest.approx(0.2, abs=0.01)


def test_the_step_follows_the_quartiles_of_the_window() -> None:
    route = RouteScores(1001, {0.2: 0.5})
    for i in range(1001):  # scores 0.000 .. 1.000: quartiles 0.25 and 0.75
        route.observe(i / 1000, shared=False)
    route.recompute()
    assert route.targets[0.2].step == pytest.approx(STEP_IQR * 0.5)
