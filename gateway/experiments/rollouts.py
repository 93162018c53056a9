"""The live rollouts of one gateway process: its view of every route's state, arms, samples and the ticker.

Every replica reads the states (on each pub/sub message and at least once a second) and serves from its
last good read; a replica whose read is older than STALE_AFTER_S serves stable and stops shadows. Only
the leader (a store lock with a fencing token) calls step(); any replica may abort at once when the
counters it has just written show a hard error-rate breach. All state changes are compare-and-set on
the generation, so a stale writer loses instead of overwriting.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from gateway.policy.model import Policy
from gateway.rollout.analysis import GUARD_NAMES, evaluate
from gateway.rollout.assignment import Assignment, assign_session
from gateway.rollout.samples import (
    Cohort,
    Observations,
    PairOutcome,
    ProcessSample,
    Sample,
    counter_fields,
    pair_field,
    process_fields,
)
from gateway.rollout.spec import RolloutSpec, ShadowSpec
from gateway.rollout.state import Arm, InvalidTransition, Phase, RolloutState, StaleGeneration
from gateway.rollout.stats import Status, breaches_slo
from gateway.rollout.step import TICK_S, abort, start, step
from gateway.store.contract import StoreError
from gateway.store.rollouts import RolloutKeys, RolloutStore
from gateway.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

STALE_AFTER_S = 2.0  # a replica that has not read the states this long fails safe to stable
FLUSH_S = 0.1  # counters are batched this long: the instant abort sees a breach within it
LOCK_TTL_S = 3.0  # a dead leader's lock passes to another replica after this
RETRY_S = 0.5
ARM_TTL_S = 3600  # how long a session's recorded arm outlives its last step (each step renews it)
SAMPLES_TTL_S = 7 * 86400
ARM_CACHE_SIZE = 50_000
SESSION_SOURCES = ("session=", "header:x-session-id=")


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


class Rollouts:
    """Owns the background tasks (sync, ticker, counter flush) and the local caches of one process."""

    def __init__(
        self,
        store: RolloutStore,
        current: Callable[[], Policy],
        metrics: Metrics,
        *,
        prefix: str = "ag",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store, self.keys, self._current, self._clock = store, RolloutKeys(prefix), current, clock
        self.owner = secrets.token_hex(8)
        self.states: dict[str, RolloutState] = {}
        self.synced_at = -math.inf  # time.monotonic() of the last complete read of every state
        self.leading = False
        self._indexed: tuple[Policy | None, Index] = (None, Index({}, {}))
        self._pending: dict[str, Counter[str]] = {}
        self._specs: dict[str, tuple[str, RolloutSpec]] = {}  # samples key -> (route, spec), for aborts
        self._arms: OrderedDict[str, Assignment] = OrderedDict()
        self._touched: set[str] = set()  # arms stepped on since the last flush: their TTL is renewed then
        self._tasks: list[asyncio.Task[None]] = []
        self.stale, self.weight = metrics.rollout_stale, metrics.rollout_weight
        self.phase, self.step, self.verdict = metrics.rollout_phase, metrics.rollout_step, metrics.rollout_verdict

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

    async def arm(self, state: RolloutState, key: str | None) -> Assignment:
        """The request's arm; a session's first arm is recorded (SET NX) and kept for its trajectory: each
        step renews it (batched into the next flush), so it lapses only ARM_TTL_S after the last step."""
        if key is None or not key.startswith(SESSION_SOURCES) or state.weight_pct >= 100:
            return assign_session(state, key, None) or Assignment(state.rollout_id, state.run, Arm.STABLE)
        cache_key = self.keys.arm(state.rollout_id, state.run, key)
        recorded = self._arms.get(cache_key)
        if recorded is None:
            fresh = assign_session(state, key, None)
            assert fresh is not None
            try:
                recorded = Assignment.decode(
                    await self.store.record_arm(cache_key, fresh.encode(), ARM_TTL_S)
                )
            except StoreError:
                return Assignment(state.rollout_id, state.run, Arm.STABLE)  # fail safe, not remembered
            recorded = recorded or fresh
            self._arms[cache_key] = recorded
            if len(self._arms) > ARM_CACHE_SIZE:
                self._arms.popitem(last=False)
        self._touched.add(cache_key)
        return assign_session(state, key, recorded) or recorded

    def samples_key(self, state: RolloutState) -> str:
        return self.keys.samples(state.rollout_id, state.run, state.window)

    def record(
        self, route: str, spec: RolloutSpec, state: RolloutState, cohort: Cohort, sample: Sample
    ) -> None:
        """Count one served request into its cohort; written to the store by the flush task."""
        key = self.samples_key(state)
        pending = self._pending.setdefault(key, Counter())
        for name in counter_fields(cohort, sample):
            pending[name] += 1
        self._specs[key] = (route, spec)

    def record_process(
        self, route: str, spec: RolloutSpec, state: RolloutState, cohort: Cohort, sample: ProcessSample
    ) -> None:
        """Count one agent step's process facts into its cohort (from the trajectory flusher)."""
        fields = process_fields(cohort, sample)
        if not fields:
            return
        key = self.samples_key(state)
        pending = self._pending.setdefault(key, Counter())
        pending.update(fields)
        self._specs[key] = (route, spec)

    def count_outcome(self, rollout_id: str, run: int, window: int, fields: dict[str, int]) -> None:
        """Add (or take back) one agent session's outcome counters in the window its steps were measured in."""
        pending = self._pending.setdefault(self.keys.samples(rollout_id, run, window), Counter())
        pending.update(fields)

    def record_outcome(self, samples_key: str, outcome: PairOutcome) -> None:
        self._pending.setdefault(samples_key, Counter())[pair_field(outcome)] += 1

    async def observe(self, state: RolloutState) -> Observations:
        return Observations.from_counts(await self.store.counts(self.samples_key(state)))

    # --- background tasks ---

    def start_tasks(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._sync(), name="rollout-sync"),
            loop.create_task(self._every(TICK_S, self.tick), name="rollout-ticker"),
            loop.create_task(self._every(FLUSH_S, self.flush), name="rollout-flush"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(StoreError):
            await self.flush()  # the store itself is closed by its owner (create_app's cleanup)

    async def _every(self, period_s: float, job: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                await job()
            except StoreError as exc:
                log.debug("rollout %s: %s", job.__name__, exc)
            except Exception:  # one bad tick (a state written by a newer version…) must not end the loop
                log.exception("rollout %s failed", job.__name__)

    async def _sync(self) -> None:
        """Re-read the states on every published change, and at least once a second without one."""
        while True:
            try:
                await self.refresh()
                async for _route in self.store.changes():
                    await self.refresh()
            except StoreError as exc:
                log.debug("rollout sync: %s", exc)
            except Exception:
                log.exception("rollout sync failed")
            self._update_stale()
            await asyncio.sleep(RETRY_S)

    async def refresh(self) -> None:
        routes = list(self.index(self._current()).rollouts)
        found: dict[str, RolloutState] = {}
        for route in routes:
            raw = await self.store.read_state(route)
            if raw is not None:
                found[route] = RolloutState.from_dict(json.loads(raw))
        self.states = found
        self.synced_at = time.monotonic()
        self._update_stale()

    def _update_stale(self) -> None:
        fresh = self.fresh()
        self.stale.set(0 if fresh else 1)
        for route, spec in self.index(self._current()).rollouts.items():
            state = self.state(spec)
            self.weight.labels(route).set(state.weight_pct if state is not None and fresh else 0)
            known = self.states.get(route)
            if known is not None and known.rollout_id == spec.id:
                self._export_phase(route, known)

    def _export_phase(self, route: str, state: RolloutState) -> None:
        """The stored phase and step, whatever this replica serves by (a stale replica still reports them)."""
        for phase in Phase:
            self.phase.labels(route, phase.value).set(1 if state.phase is phase else 0)
        self.step.labels(route).set(state.step_index)

    def _export_verdicts(self, route: str, spec: RolloutSpec, state: RolloutState, obs: Observations) -> None:
        """Each guard's interim status as the leader's tick saw it (a guard not evaluated shows no status)."""
        verdicts = evaluate(spec, obs, final=False, shadow_active=state.shadow_pct > 0)
        found = {v.metric.removesuffix("_slo"): v.status for v in verdicts}  # error_rate_slo: a hard breach
        for guard in GUARD_NAMES:
            for status in Status:
                self.verdict.labels(route, guard, status.value).set(1 if found.get(guard) is status else 0)

    async def tick(self) -> None:
        """The leader steps every rollout once; a new or replaced rollout starts at step 0."""
        rollouts = self.index(self._current()).rollouts
        if not rollouts:
            return
        token = await self.store.lead(self.owner, LOCK_TTL_S)
        self.leading = token is not None
        if token is None:
            return
        now = self._clock()
        for route, spec in rollouts.items():
            raw = await self.store.read_state(route)
            state = None if raw is None else RolloutState.from_dict(json.loads(raw))
            if state is None or state.rollout_id != spec.id:
                new = start(spec.id, now)
                expected = -1 if state is None else state.generation
                new = new if state is None else _continue_generation(new, state)
            else:
                obs = await self.observe(state)
                self._export_verdicts(route, spec, state, obs)
                new, expected = step(spec, state, obs, now), state.generation
            if new is not state and await self.store.write_state(route, expected, _dump(new), token):
                self.states[route] = new
                self._export_phase(route, new)

    async def flush(self) -> None:
        """Write the batched counters and arm renewals; a batch that proves a hard error-rate breach aborts
        at once."""
        pending, self._pending = self._pending, {}
        touched, self._touched = self._touched, set()
        if touched:
            with contextlib.suppress(StoreError):  # best effort: the session's next step renews it again
                await self.store.touch_arms(sorted(touched), ARM_TTL_S)
        for key, fields in pending.items():
            totals = await self.store.count(key, fields, SAMPLES_TTL_S)
            if "candidate.errors" in totals and key in self._specs:
                await self._abort_on_breach(key, totals)

    async def _abort_on_breach(self, key: str, totals: dict[str, int]) -> None:
        route, spec = self._specs[key]
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
                lambda s: abort(
                    s,
                    actor=f"replica {self.owner}",
                    reason=reason,
                    generation=s.generation,
                    now=self._clock(),
                ),
            )

    async def operate(
        self, route: str, spec: RolloutSpec, change: Callable[[RolloutState], RolloutState]
    ) -> RolloutState:
        """Apply a manual (or instant-abort) change to the stored state by CAS; StaleGeneration on a race. A rollout
        the leader has not started yet starts with the change: one write holds both."""
        stored = await self._stored(route)
        new = change(self._started(spec, stored))
        expected = -1 if stored is None else stored.generation
        if not await self.store.write_state(route, expected, _dump(new), 0):
            raise StaleGeneration(f"the rollout on {route!r} changed meanwhile; read it again and retry")
        self.states[route] = new
        return new

    async def current(self, route: str, spec: RolloutSpec) -> RolloutState:
        """The stored state of the route's rollout, or the one the leader will start (read only: the admin API's
        GETs read here, and the start is written by the leader's tick or by the first `operate`)."""
        return self._started(spec, await self._stored(route))

    async def _stored(self, route: str) -> RolloutState | None:
        raw = await self.store.read_state(route)
        return None if raw is None else RolloutState.from_dict(json.loads(raw))

    def _started(self, spec: RolloutSpec, state: RolloutState | None) -> RolloutState:
        """`state` if it is this rollout's, else this rollout at its start (not written)."""
        if state is not None and state.rollout_id == spec.id:
            return state
        new = start(spec.id, self._clock())
        return new if state is None else _continue_generation(new, state)


def _continue_generation(new: RolloutState, old: RolloutState) -> RolloutState:
    """A replaced rollout keeps counting generations, so a client holding the old number gets 409."""
    return replace(new, generation=old.generation + new.generation)


def _dump(state: RolloutState) -> str:
    return json.dumps(state.to_dict(), separators=(",", ":"))
