"""This replica's view of every route's rollout state: read from the store (decoded there, once a read), cached,
and served from by the request path without I/O.

The view re-reads the states on every published change and at least once a second; a replica whose last
complete read is older than STALE_AFTER_S serves stable and stops shadows (`fresh`). Nothing here writes
the store: the leader (rollout_leader.py) does, and tells the view what it wrote (`saw`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.policy.model import Policy
from gateway.rollout.spec import RolloutSpec, ShadowSpec
from gateway.rollout.state import Phase, RolloutState
from gateway.store.contract import StoreError
from gateway.store.rollouts import RolloutStore
from gateway.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

STALE_AFTER_S = 2.0  # a replica that has not read the states this long fails safe to stable
RETRY_S = 0.5


@dataclass(frozen=True, slots=True)
class Index:
    """A policy's rollouts and shadows by route, built once per policy object."""

    rollouts: dict[str, RolloutSpec]
    shadows: dict[str, tuple[ShadowSpec, ...]]


def index_of(policy: Policy) -> Index:
    shadows: dict[str, list[ShadowSpec]] = {}
    for spec in policy.shadows:
        shadows.setdefault(spec.route or "", []).append(spec)
    return Index({r.route or "": r for r in policy.rollouts}, {k: tuple(v) for k, v in shadows.items()})


class RolloutView:
    """The last good read of each route's state, its freshness, and the gauges that show it."""

    def __init__(self, store: RolloutStore, current: Callable[[], Policy], metrics: Metrics) -> None:
        self._store, self._current = store, current
        self.states: dict[str, RolloutState] = {}
        self.synced_at = -math.inf  # time.monotonic() of the last complete read of every state
        self._indexed: tuple[Policy | None, Index] = (None, Index({}, {}))
        self.stale, self.weight = metrics.rollout_stale, metrics.rollout_weight
        self.phase, self.step = metrics.rollout_phase, metrics.rollout_step

    def index(self, policy: Policy) -> Index:
        seen, found = self._indexed
        if seen is not policy:
            found = index_of(policy)
            self._indexed = (policy, found)
        return found

    def fresh(self) -> bool:
        return time.monotonic() - self.synced_at < STALE_AFTER_S

    def state(self, spec: RolloutSpec) -> RolloutState | None:
        """The state to serve by; None (serve stable) when absent, another rollout's, or stale."""
        found = self.states.get(spec.route or "")
        if found is None or found.rollout_id != spec.id or not self.fresh():
            return None
        return found

    def known(self, route: str) -> RolloutState | None:
        """The route's last read state, whatever rollout it is and however old."""
        return self.states.get(route)

    async def read(self, route: str) -> RolloutState | None:
        """The route's stored state as of now (the leader's and the admin's read); the view keeps it too."""
        found = await self._store.read_state(route)
        if found is None:
            self.states.pop(route, None)
        else:
            self.states[route] = found
        return found

    def saw(self, route: str, state: RolloutState) -> None:
        """A state this replica has just written: served by at once, before its change is announced back."""
        self.states[route] = state
        self.export_phase(route, state)

    async def follow(self) -> None:
        """Re-read the states on every published change, and at least once a second without one (a task)."""
        while True:
            try:
                await self.refresh()
                async for _route in self._store.changes():
                    await self.refresh()
            except StoreError as exc:
                log.debug("rollout sync: %s", exc)
            except Exception:
                log.exception("rollout sync failed")
            self._update_gauges()
            await asyncio.sleep(RETRY_S)

    async def refresh(self) -> None:
        found: dict[str, RolloutState] = {}
        for route in self.index(self._current()).rollouts:
            state = await self._store.read_state(route)
            if state is not None:
                found[route] = state
        self.states = found
        self.synced_at = time.monotonic()
        self._update_gauges()

    def _update_gauges(self) -> None:
        fresh = self.fresh()
        self.stale.set(0 if fresh else 1)
        for route, spec in self.index(self._current()).rollouts.items():
            state = self.state(spec)
            self.weight.labels(route).set(state.weight_pct if state is not None and fresh else 0)
            known = self.states.get(route)
            if known is not None and known.rollout_id == spec.id:
                self.export_phase(route, known)

    def export_phase(self, route: str, state: RolloutState) -> None:
        """The stored phase and step, whatever this replica serves by (a stale replica still reports them)."""
        for phase in Phase:
            self.phase.labels(route, phase.value).set(1 if state.phase is phase else 0)
        self.step.labels(route).set(state.step_index)
