"""Live complexity-share thresholds: each route's recent scores, and the score above which the top share lies.

`complexity: {hq_share: X}` means X of the route's live traffic, whatever its mix today. A fixed
threshold calibrated once cannot promise that (on unseen mixes it sent anything from 0% to 100%).
Until MIN_SAMPLES calls were seen the policy's cold-start threshold (its calibration's) stands; then
the threshold starts at the (1 - X) quantile of the route's last `window` scores and follows the
traffic by stochastic approximation (Robbins-Monro): every call moves it by STEP_IQR of the window's
interquartile range times (hit - X). Its equilibrium is the same quantile, but unlike re-reading the
quantile of a finite window (whose sampling error re-appears in every window), the share it serves
over n calls is X + (threshold drift) / (step * n): it cannot stay off target. Simulated on two
benchmark mixes (500-call warm-up, 600 calls measured, 40 seeds) the served share was within 0.8
points of the target; re-reading the window's quantile missed by up to 3.2. Replicas share their
windows through the store (experiments/shares.py); this module is the pure part: no I/O, bounded
memory, O(1) per call between recomputes.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gateway.policy.model import Policy

RECOMPUTE_EVERY = 32  # calls between refreshes of the step size (each sorts the window)
MIN_SAMPLES = 50  # fewer recent scores than this: the cold-start threshold
STEP_IQR = 0.1  # the threshold's step per call, in interquartile ranges of the window's scores


@dataclass(slots=True)
class ShareTarget:
    """One target share on one route: the threshold in force and which recent calls were above it."""

    share: float
    cold_threshold: float
    live_threshold: float | None = None
    step: float = 0.0
    above: deque[bool] = field(default_factory=deque)

    @property
    def threshold(self) -> float:
        return self.cold_threshold if self.live_threshold is None else self.live_threshold

    @property
    def observed(self) -> float | None:
        """The share of the route's recent calls whose score was at or above the threshold then in force."""
        return sum(self.above) / len(self.above) if self.above else None


class RouteScores:
    """A route's recent scores (bounded) and its targets' live thresholds."""

    def __init__(self, window: int, targets: Mapping[float, float]) -> None:
        self.window = window
        self.scores: deque[float] = deque(maxlen=window)
        self.pending: list[float] = []  # observed here since the last exchange with the store
        self.targets = {share: ShareTarget(share, cold, above=deque(maxlen=window)) for share, cold in targets.items()}
        self.thresholds: dict[float, float] = {s: t.threshold for s, t in self.targets.items()}
        self._since = 0

    def observe(self, score: float, shared: bool) -> None:
        for share, target in self.targets.items():
            hit = score >= target.threshold
            target.above.append(hit)
            if target.live_threshold is not None:
                target.live_threshold += target.step * (hit - share)
                self.thresholds[share] = target.live_threshold
        self.scores.append(score)
        if shared:
            self.pending.append(score)
        self._since += 1
        if self._since >= RECOMPUTE_EVERY:
            self.recompute()

    def replace(self, scores: Iterable[float]) -> None:
        """Take the fleet's merged window (the store's answer) in place of this replica's own: a new replica
        starts from the fleet's quantile, and every replica's step follows the fleet's spread."""
        self.scores = deque(scores, maxlen=self.window)
        self.recompute()

    def recompute(self) -> None:
        """Refresh the step size from the window's spread; start a target's live threshold at its quantile."""
        self._since = 0
        n = len(self.scores)
        if n < MIN_SAMPLES:
            return
        scores = sorted(self.scores)  # numpy's partition is faster, but numpy would weigh on the process's memory
        low, high = interquartile(scores)
        for share, target in self.targets.items():
            target.step = STEP_IQR * max(high - low, 1e-9)
            if target.live_threshold is None:
                target.live_threshold = top_share_threshold(scores, share)
            self.thresholds[share] = target.live_threshold


def interquartile(ascending: list[float]) -> tuple[float, float]:
    """The window's lower and upper quartiles, as order statistics (a step size needs no interpolated quartile)."""
    n = len(ascending)
    return ascending[(n - 1) // 4], ascending[(3 * (n - 1)) // 4]


def top_share_threshold(ascending: list[float], share: float) -> float:
    """The score t with the top `share` of the scores at or above it: the k-th largest, k = ceil(share * n)."""
    n = len(ascending)
    k = min(n, max(1, math.ceil(share * n)))
    return ascending[n - k]


class ShareTracker:
    """Every rule-routed model's recent scores, shaped by the live policy's share targets."""

    def __init__(self, shared: bool = False) -> None:
        self.shared = shared  # replicas exchange windows through the store: keep what is new for it
        self.routes: dict[str, RouteScores] = {}
        self._targets: dict[float, float] = {}
        self._window = 0
        self._policy: Policy | None = None

    def follow(self, policy: Policy) -> None:
        """Take a (re)loaded policy's targets; a route keeps its scores when only the targets change."""
        if policy is self._policy:
            return
        self._policy = policy
        window, cold = max(policy.share_windows.values(), default=0), policy.share_cold_thresholds
        if cold == self._targets and window == self._window:
            return
        self._targets, self._window = dict(cold), window
        for name, old in list(self.routes.items()):
            route = RouteScores(window, cold) if window else None
            if route is None:
                del self.routes[name]
                continue
            route.scores.extend(old.scores)
            route.recompute()
            self.routes[name] = route

    def observe(self, route: str, score: float) -> Mapping[float, float]:
        """Count one scored call of `route`; the thresholds its decision uses (those in force before it)."""
        found = self.routes.get(route)
        if found is None:
            if not self._targets:
                return {}
            found = self.routes[route] = RouteScores(self._window, self._targets)
        thresholds = dict(found.thresholds)
        found.observe(score, self.shared)
        return thresholds

    def thresholds(self, route: str) -> Mapping[float, float]:
        """The thresholds a call of `route` would get now, without counting it."""
        found = self.routes.get(route)
        return dict(found.thresholds) if found is not None else dict(self._targets)

    def describe(self, route: str) -> dict[str, dict[str, float | int | str | None]]:
        """Per target share: the threshold in force, where it comes from, and the share actually observed."""
        found = self.routes.get(route)
        if found is None:
            return {f"{s:g}": {"target": s, "threshold": t, "source": "calibration", "observed": None,
                               "samples": 0} for s, t in self._targets.items()}
        return {f"{s:g}": {"target": s, "threshold": t.threshold,
                           "source": "calibration" if t.live_threshold is None else "live",
                           "observed": t.observed, "samples": len(found.scores), "window": found.window}
                for s, t in found.targets.items()}
