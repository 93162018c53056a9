"""Live shares of traffic: what each label (deployment, rule, rollout arm) served over the last minute, from
successive readings of the cumulative request counters."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

Labels = tuple[tuple[str, str], ...]  # a counter's label set, sorted by name
Totals = Mapping[Labels, float]

WINDOW_S = 60.0
MAX_READINGS = 512


@dataclass(frozen=True, slots=True)
class Counts:
    """How many requests each label set counted between two readings, `span_s` apart."""

    span_s: float
    by_labels: dict[Labels, float]

    def by(self, label: str, where: Mapping[str, str] | None = None) -> dict[str, float]:
        """Summed by one label's value, keeping only label sets that match `where`."""
        found: dict[str, float] = {}
        for labels, count in self.by_labels.items():
            named = dict(labels)
            if where and any(named.get(k) != v for k, v in where.items()):
                continue
            value = named.get(label, "")
            found[value] = found.get(value, 0.0) + count
        return found


def shares(counts: Mapping[str, float], skip: Iterable[str] = ()) -> dict[str, float]:
    """Each key's fraction of the total (keys in `skip` counted in neither); empty when nothing was counted."""
    kept = {k: v for k, v in counts.items() if k not in set(skip) and v > 0}
    total = sum(kept.values())
    return {k: v / total for k, v in sorted(kept.items())} if total else {}


class Window:
    """Readings of one counter family; each reading is compared with the newest one at least `window_s`
    older, or with the oldest kept: the counters' zero when the server started, for its first minute."""

    def __init__(self, started_at: float, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._readings: deque[tuple[float, dict[Labels, float]]] = deque([(started_at, {})], maxlen=MAX_READINGS)

    def read(self, now: float, totals: Totals) -> Counts:
        current = dict(totals)
        while len(self._readings) > 1 and now - self._readings[1][0] >= self.window_s:
            self._readings.popleft()  # the next one is old enough to be the baseline
        at, before = self._readings[0]
        self._readings.append((now, current))
        # A counter below its earlier reading has restarted (a worker replaced): count it from zero.
        deltas = {k: v - before.get(k, 0.0) if v >= before.get(k, 0.0) else v for k, v in current.items()}
        return Counts(now - at, deltas)


class TrafficWindows:
    """The windows /admin/deployments reads: requests by deployment and rule, and requests by rollout arm."""

    def __init__(self, started_at: float) -> None:
        self.requests = Window(started_at)
        self.arms = Window(started_at)
