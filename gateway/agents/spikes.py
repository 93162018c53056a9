"""Cost spikes: a session's or tenant's spend rate against its own recent baseline, robustly estimated.

Spend is kept in buckets of BUCKET_S seconds ({bucket index: USD}). The rate is the spend of the last
`window_s` per minute; the baseline is the median plus 1.4826 MADs (a robust upper-typical level, not
moved by one odd window) of the rates of the up to `history_windows` earlier windows that lie wholly
after `since` (the session's or tenant's first spend). A spike is a rate at or above the floor and above
`factor` times the baseline, once at least `min_windows` earlier windows exist.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gateway.policy.agents import SpikePolicy

BUCKET_S = 10.0
MAD_SCALE = 1.4826  # makes the MAD estimate a normal distribution's standard deviation


def bucket(at: float) -> int:
    return math.floor(at / BUCKET_S)


def buckets(spends: Iterable[tuple[float, float]]) -> dict[int, float]:
    """(time, USD) points as bucketed spend."""
    out: dict[int, float] = {}
    for at, usd in spends:
        index = bucket(at)
        out[index] = out.get(index, 0.0) + usd
    return out


@dataclass(frozen=True, slots=True)
class Spike:
    rate_usd_per_min: float
    baseline_usd_per_min: float
    windows: int

    def describe(self, who: str) -> str:
        return (f"{who} spends {self.rate_usd_per_min:.4g} USD/min, above its baseline of "
                f"{self.baseline_usd_per_min:.4g} USD/min (median + MAD of {self.windows} earlier windows)")


def spike(spend: Mapping[int, float], since: float, now: float, rules: SpikePolicy) -> Spike | None:
    """The spike the bucketed spend shows at `now`, else None (cheap when the rate is under the floor)."""
    if now - since < rules.min_windows * rules.window_s:
        return None  # too young for a baseline: the common case of a session's first steps, kept cheap
    width = max(1, round(rules.window_s / BUCKET_S))
    last = bucket(now)
    per_min = 60.0 / (width * BUCKET_S)
    rate = _sum(spend, last - width + 1, last) * per_min
    if rate < rules.floor_usd_per_min or rate <= 0:
        return None
    first = bucket(since)
    earlier = []
    for k in range(1, rules.history_windows + 1):
        end = last - k * width
        if end - width + 1 < first:
            break
        earlier.append(_sum(spend, end - width + 1, end) * per_min)
    if len(earlier) < rules.min_windows:
        return None
    median = statistics.median(earlier)
    mad = statistics.median(abs(r - median) for r in earlier)
    baseline = median + MAD_SCALE * mad
    if rate <= rules.factor * baseline:
        return None
    return Spike(rate, baseline, len(earlier))


def _sum(spend: Mapping[int, float], first: int, last: int) -> float:
    return sum(spend.get(i, 0.0) for i in range(first, last + 1))
