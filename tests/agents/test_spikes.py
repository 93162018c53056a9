"""Cost spikes: the last window's spend rate against the median + MAD of the windows before it."""

from __future__ import annotations

from gateway.agents.spikes import BUCKET_S, buckets, spike
from gateway.policy.agents import SpikePolicy

RULES = SpikePolicy(factor=4, floor_usd_per_min=0.1, window_s=60, history_windows=10, min_windows=3)
T0 = 1_000_000 * BUCKET_S  # a bucket's start


def _minutely(*usd: float) -> dict[int, float]:
    """One spend per minute, the last one now."""
    return buckets((T0 + 60 * i, v) for i, v in enumerate(usd))


def _now(spend: dict[int, float]) -> float:
    return max(spend) * BUCKET_S


def test_a_rate_past_factor_times_the_baseline_and_the_floor_is_a_spike() -> None:
    spend = _minutely(0.05, 0.06, 0.05, 0.07, 0.5)
    found = spike(spend, T0, _now(spend), RULES)
    # the window holding the first spend began before it: not history (windows end at `now`, not at `since`)
    assert found is not None and found.rate_usd_per_min == 0.5 and found.windows == 3
    assert 0.05 < found.baseline_usd_per_min < 0.08
    assert "0.5 USD/min" in found.describe("the session")


def test_below_the_floor_or_the_factor_nothing_is_flagged() -> None:
    spend = _minutely(0.001, 0.001, 0.001, 0.09)  # 90x its baseline, but under the floor
    assert spike(spend, T0, _now(spend), RULES) is None
    spend = _minutely(0.1, 0.1, 0.1, 0.35)
    assert spike(spend, T0, _now(spend), RULES) is None


def test_one_odd_window_does_not_move_the_baseline() -> None:
    spend = _minutely(0.05, 2.0, 0.05, 0.05, 0.05, 0.5)
    assert spike(spend, T0, _now(spend), RULES) is not None


def test_too_little_history_is_no_baseline() -> None:
    spend = _minutely(0.01, 0.01, 0.9)
    assert spike(spend, T0, _now(spend), RULES) is None  # two earlier windows, three needed
    assert spike(spend, T0 - 600, _now(spend), RULES) is not None  # idle since long before: zero baseline


def test_windows_before_the_start_are_not_history() -> None:
    spend = _minutely(0.01, 0.01, 0.01, 0.01, 0.9)
    assert spike(spend, T0 + 120, _now(spend), RULES) is None
