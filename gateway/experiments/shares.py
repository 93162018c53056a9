"""Keeps the live complexity-share thresholds in step across replicas (the fleet's score windows through the
store, once a second, off the request path), and exports each route's target, served share and threshold as
metrics when /metrics is scraped."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from gateway.decision.share import ShareTracker
from gateway.policy.model import Policy
from gateway.store.contract import StoreError
from gateway.store.shares import ShareWindowStore
from gateway.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

SYNC_PERIOD_S = 1.0


async def keep_in_step(tracker: ShareTracker, store: ShareWindowStore, current: Callable[[], Policy]) -> None:
    """Every SYNC_PERIOD_S, exchange this replica's windows with the fleet's (run only with a shared store)."""
    failing = False
    while True:
        await asyncio.sleep(SYNC_PERIOD_S)
        tracker.follow(current())
        try:
            await _exchange(tracker, store)
            failing = False
        except StoreError as exc:
            if not failing:  # once per outage: the local window keeps the thresholds going meanwhile
                log.warning("share windows not exchanged (%s); thresholds follow this replica's calls", exc)
            failing = True


async def _exchange(tracker: ShareTracker, store: ShareWindowStore) -> None:
    for name, route in list(tracker.routes.items()):
        sent, route.pending = route.pending, []
        try:
            merged = await store.share_window(name, sent, route.window)
        except StoreError:
            route.pending[:0] = sent[-route.window:]  # try again next time, bounded
            raise
        route.replace(merged)


def export(tracker: ShareTracker, metrics: Metrics) -> None:
    for name, route in tracker.routes.items():
        for share, target in route.targets.items():
            label = f"{share:g}"
            metrics.share_target.labels(name, label).set(share)
            metrics.share_threshold.labels(name, label).set(target.threshold)
            observed = target.observed
            if observed is not None:
                metrics.share_observed.labels(name, label).set(observed)
