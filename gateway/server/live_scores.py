"""The live gateway's complexity scores and share thresholds, for decision/gathering.gather."""

from __future__ import annotations

import time
from collections.abc import Mapping

from aiohttp import web

from gateway.features import Features
from gateway.policy.model import Policy
from gateway.server.resources import STATE


class LiveScoring:
    """The process's classifier (or the policy's own), timed into the metrics, and the live share thresholds.

    `observed`: this call counts toward the route's share window; False for a dry run (`POST /admin/explain`).
    """

    __slots__ = ("app", "observed")

    def __init__(self, app: web.Application, observed: bool) -> None:
        self.app, self.observed = app, observed

    def score(self, policy: Policy, features: Features) -> float:
        state = self.app[STATE]
        started = time.perf_counter()
        score = policy.classifier_or(state.classifier).score(features)
        cost = state.metrics.scoring
        cost.seconds += time.perf_counter() - started
        cost.scores += 1
        return score

    def thresholds(self, policy: Policy, route: str, complexity: float) -> Mapping[float, float]:
        shares = self.app[STATE].shares
        shares.follow(policy)
        return shares.observe(route, complexity) if self.observed else shares.thresholds(route)
