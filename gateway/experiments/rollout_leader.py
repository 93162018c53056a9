"""The writes of rollout state: the leader's tick (one replica, holding a store lock with a fencing token, steps
every rollout once a tick), the instant abort (any replica, when the counters it has just written prove a hard
error-rate breach) and the audited manual operations. Every write is compare-and-set on the generation, so a
stale writer loses instead of overwriting. Reading, for the admin API, writes nothing (`current`).
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable
from dataclasses import replace

from gateway.experiments.rollout_counters import RolloutCounters
from gateway.experiments.rollout_view import RolloutView
from gateway.policy.model import Policy
from gateway.rollout.analysis import GUARD_NAMES, evaluate
from gateway.rollout.samples import Observations
from gateway.rollout.spec import RolloutSpec
from gateway.rollout.state import InvalidTransition, RolloutState, StaleGeneration
from gateway.rollout.stats import Status, breaches_slo
from gateway.rollout.step import abort, start, step
from gateway.store.rollouts import RolloutStore
from gateway.telemetry.metrics import Metrics

LOCK_TTL_S = 3.0  # a dead leader's lock passes to another replica after this
NO_FENCE = 0  # a manual operation or the instant abort: CAS on the generation only, no lock needed


class RolloutLeader:
    """This replica's part in writing rollout states (leading or not) and the guards' verdict gauges."""

    def __init__(
        self,
        store: RolloutStore,
        view: RolloutView,
        counters: RolloutCounters,
        current: Callable[[], Policy],
        metrics: Metrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store, self._view, self._counters, self._current, self._clock = store, view, counters, current, clock
        self.owner = secrets.token_hex(8)
        self.leading = False
        self.verdict = metrics.rollout_verdict

    async def tick(self) -> None:
        """The leader steps every rollout once; a new or replaced rollout starts at step 0."""
        rollouts = self._view.index(self._current()).rollouts
        if not rollouts:
            return
        token = await self._store.lead(self.owner, LOCK_TTL_S)
        self.leading = token is not None
        if token is None:
            return
        now = self._clock()
        for route, spec in rollouts.items():
            state = await self._view.read(route)
            if state is None or state.rollout_id != spec.id:
                new, expected = _started(spec, state, now), _generation(state)
            else:
                obs = await self._counters.observe(state)
                self._export_verdicts(route, spec, state, obs)
                new, expected = step(spec, state, obs, now), state.generation
            if new is not state and await self._store.write_state(route, expected, new, token):
                self._view.saw(route, new)

    async def current(self, route: str, spec: RolloutSpec) -> RolloutState:
        """The stored state of the route's rollout; one the ticker has not started yet reads as it would start
        (written by nobody here: a read never writes)."""
        state = await self._view.read(route)
        if state is not None and state.rollout_id == spec.id:
            return state
        return _started(spec, state, self._clock())

    async def operate(
        self, route: str, spec: RolloutSpec, change: Callable[[RolloutState], RolloutState]
    ) -> RolloutState:
        """Apply a manual (or instant-abort) change to the stored state by CAS; StaleGeneration on a race. A
        rollout the ticker has not started yet is started and changed in the one write."""
        stored = await self._view.read(route)
        base = stored if stored is not None and stored.rollout_id == spec.id else _started(spec, stored, self._clock())
        new = change(base)
        if not await self._store.write_state(route, _generation(stored), new, NO_FENCE):
            raise StaleGeneration(f"the rollout on {route!r} changed meanwhile; read it again and retry")
        self._view.saw(route, new)
        return new

    async def abort_on_breach(self, route: str, spec: RolloutSpec, totals: dict[str, int]) -> None:
        """Abort at once when the candidate's errors so far prove its error-rate SLO breached."""
        guard = spec.guards.error_rate
        k, n = totals["candidate.errors"], totals.get("candidate.requests", 0)
        if guard is None or not breaches_slo(k, n, guard.slo, spec.interim_alpha):
            return
        reason = f"error_rate_slo: {k} errors in {n} requests breach the {guard.slo:g} SLO"
        # Another replica (or the leader's tick) may have aborted first: then there is nothing to do.
        with contextlib.suppress(StaleGeneration, InvalidTransition):
            await self.operate(
                route,
                spec,
                lambda s: abort(s, actor=f"replica {self.owner}", reason=reason, generation=s.generation,
                                now=self._clock()),
            )

    def _export_verdicts(self, route: str, spec: RolloutSpec, state: RolloutState, obs: Observations) -> None:
        """Each guard's interim status as the leader's tick saw it (a guard not evaluated shows no status)."""
        verdicts = evaluate(spec, obs, final=False, shadow_active=state.shadow_pct > 0)
        found = {v.metric.removesuffix("_slo"): v.status for v in verdicts}  # error_rate_slo: a hard breach
        for guard in GUARD_NAMES:
            for status in Status:
                self.verdict.labels(route, guard, status.value).set(1 if found.get(guard) is status else 0)


def _started(spec: RolloutSpec, replaced: RolloutState | None, now: float) -> RolloutState:
    """The spec's rollout at step 0; one replacing another keeps counting generations, so a client holding the
    old number gets 409."""
    new = start(spec.id, now)
    return new if replaced is None else replace(new, generation=replaced.generation + new.generation)


def _generation(stored: RolloutState | None) -> int:
    """The generation a compare-and-set expects: -1 for no state at all."""
    return -1 if stored is None else stored.generation
