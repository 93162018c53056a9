"""The live rollouts of one gateway process: its view of the states, the sessions' arms, the cohort counters and
the leader, composed, and the three background tasks that keep them going. Callers reach each part by its
attribute and call it there (`rollouts.view.state(spec)`, `rollouts.counters.record(...)`); `Rollouts` itself
only starts, flushes and closes.

    view      rollout_view.py      every route's state as last read (decoded once a read), served from without I/O
    arms      session_arms.py      a request's arm; a session's first arm recorded and renewed by its steps
    counters  rollout_counters.py  each cohort's outcome counters, batched into the store
    leader    rollout_leader.py    the writes: the leader's tick, the instant abort, the manual operations (CAS)

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
from gateway.experiments.rollout_view import RolloutView
from gateway.experiments.session_arms import SessionArms
from gateway.policy.model import Policy
from gateway.rollout.step import TICK_S
from gateway.store.contract import StoreError
from gateway.store.rollouts import RolloutKeys, RolloutStore
from gateway.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

FLUSH_S = 0.1  # counters are batched this long: the instant abort sees a breach within it


class Rollouts:
    """The four parts, composed, and the owner of their background tasks. Callers use the part that does the
    job: `view` (state, fresh, index), `arms` (arm), `counters` (record, observe…), `leader` (current, operate)."""

    def __init__(
        self,
        store: RolloutStore,
        current: Callable[[], Policy],
        metrics: Metrics,
        *,
        prefix: str = "ag",
        clock: Callable[[], float] = time.time,
    ) -> None:
        keys = RolloutKeys(prefix)
        self.view = RolloutView(store, current, metrics)
        self.arms = SessionArms(store, keys)
        self.counters = RolloutCounters(store, keys)
        self.leader = RolloutLeader(store, self.view, self.counters, current, metrics, clock)
        self._tasks: list[asyncio.Task[None]] = []

    async def flush(self) -> None:
        """Renew the arms stepped on and write the batched counters; a batch that proves a hard error-rate
        breach aborts at once."""
        await self.arms.renew()
        await self.counters.flush(self.leader.abort_on_breach)

    def start_tasks(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self.view.follow(), name="rollout-sync"),
            loop.create_task(_every(TICK_S, self.leader.tick), name="rollout-ticker"),
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
