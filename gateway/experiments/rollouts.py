"""The live rollouts of one gateway process: its view of the states, the sessions' arms, the cohort counters and
the leader, and the three background tasks that keep them going.

    rollout_view.py      every route's state as last read (decoded once a read), served from without I/O
    session_arms.py      a request's arm; a session's first arm recorded and renewed by its steps
    rollout_counters.py  each cohort's outcome counters, batched into the store
    rollout_leader.py    the writes: the leader's tick, the instant abort, the manual operations (CAS)

Every replica follows the states (on each pub/sub message and at least once a second) and serves from its
last good read; only the leader steps; any replica may abort at once when the counters it has just written
show a hard error-rate breach.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from gateway.experiments.rollout_counters import RolloutCounters
from gateway.experiments.rollout_leader import RolloutLeader
from gateway.experiments.rollout_view import Index, RolloutView
from gateway.experiments.session_arms import SessionArms
from gateway.policy.model import Policy
from gateway.rollout.assignment import Assignment
from gateway.rollout.samples import Cohort, Observations, PairOutcome, ProcessSample, Sample
from gateway.rollout.spec import RolloutSpec
from gateway.rollout.state import RolloutState
from gateway.rollout.step import TICK_S
from gateway.store.contract import StoreError
from gateway.store.rollouts import RolloutKeys, RolloutStore
from gateway.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

FLUSH_S = 0.1  # counters are batched this long: the instant abort sees a breach within it


class Rollouts:
    """The composition the request path, the admin API and the recorders call; owns the background tasks."""

    def __init__(
        self,
        store: RolloutStore,
        current: Callable[[], Policy],
        metrics: Metrics,
        *,
        prefix: str = "ag",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.keys = RolloutKeys(prefix)
        self.view = RolloutView(store, current, metrics)
        self.arms = SessionArms(store, self.keys)
        self.counters = RolloutCounters(store, self.keys)
        self.leader = RolloutLeader(store, self.view, self.counters, current, metrics, clock)
        self._tasks: list[asyncio.Task[None]] = []

    # --- reading (the view) ---

    def index(self, policy: Policy) -> Index:
        return self.view.index(policy)

    def fresh(self) -> bool:
        return self.view.fresh()

    def state(self, spec: RolloutSpec) -> RolloutState | None:
        return self.view.state(spec)

    async def arm(self, state: RolloutState, key: str | None) -> Assignment:
        return await self.arms.arm(state, key)

    # --- counting ---

    def samples_key(self, state: RolloutState) -> str:
        return self.counters.samples_key(state)

    def record(self, route: str, spec: RolloutSpec, state: RolloutState, cohort: Cohort, sample: Sample) -> None:
        self.counters.record(route, spec, state, cohort, sample)

    def record_process(
        self, route: str, spec: RolloutSpec, state: RolloutState, cohort: Cohort, sample: ProcessSample
    ) -> None:
        self.counters.record_process(route, spec, state, cohort, sample)

    def count_outcome(self, rollout_id: str, run: int, window: int, fields: dict[str, int]) -> None:
        self.counters.count_outcome(rollout_id, run, window, fields)

    def record_outcome(self, samples_key: str, outcome: PairOutcome) -> None:
        self.counters.record_outcome(samples_key, outcome)

    async def observe(self, state: RolloutState) -> Observations:
        return await self.counters.observe(state)

    # --- the admin API's reads and writes (the leader) ---

    @property
    def owner(self) -> str:
        return self.leader.owner

    @property
    def leading(self) -> bool:
        return self.leader.leading

    async def current(self, route: str, spec: RolloutSpec) -> RolloutState:
        return await self.leader.current(route, spec)

    async def operate(
        self, route: str, spec: RolloutSpec, change: Callable[[RolloutState], RolloutState]
    ) -> RolloutState:
        return await self.leader.operate(route, spec, change)

    # --- background tasks ---

    async def tick(self) -> None:
        await self.leader.tick()

    async def flush(self) -> None:
        """Renew the arms stepped on and write the batched counters; a batch that proves a hard error-rate
        breach aborts at once."""
        await self.arms.renew()
        await self.counters.flush(self.leader.abort_on_breach)

    def start_tasks(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self.view.follow(), name="rollout-sync"),
            loop.create_task(_every(TICK_S, self.tick), name="rollout-ticker"),
            loop.create_task(_every(FLUSH_S, self.flush), name="rollout-flush"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(StoreError):
            await self.flush()  # the store itself is closed by its owner (create_app's cleanup)


async def _every(period_s: float, job: Callable[[], Awaitable[None]]) -> None:
    while True:
        await asyncio.sleep(period_s)
        try:
            await job()
        except StoreError as exc:
            log.debug("rollout %s: %s", job.__name__, exc)
        except Exception:  # one bad tick (a state written by a newer version…) must not end the loop
            log.exception("rollout %s failed", job.__name__)
