"""Task outcomes at run time: a report (from the outcome API or a step's `x-session-outcome` header) written
to the session's record, counted in the outcome metrics and, for a session measured in a rollout cohort,
in that cohort's counters the task_success_rate and cost_per_success guards judge."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Protocol

from gateway.decision.outcomes import Membership, Outcome, mix
from gateway.decision.trajectory import Summary
from gateway.rollout.samples import Cohort, OutcomeSample, outcome_fields
from gateway.store.trajectories import TrajectoryStore
from gateway.telemetry import metrics as t


class CohortCounts(Protocol):
    """Where a session's outcome counts toward its rollout's guards (experiments.rollout_counters.RolloutCounters)."""

    def count_outcome(self, rollout_id: str, run: int, window: int, fields: dict[str, int]) -> None: ...


class Outcomes:
    """Writes reports and counts them; `counters` is wired once the experiments exist (None: no rollouts).

    An agent reports right after its last step, before the recorder has written that step (it flushes every
    FLUSH_S): a report first waits for this process's queued steps (`settle`), so the outcome is given the
    spend and steps of the run's last step too; a session still not found waits one more flush interval
    (its steps may sit in another replica's queue) and is looked up again before it is "unknown".
    """

    def __init__(self, store: TrajectoryStore, metrics: t.Metrics, clock: Callable[[], float] = time.time,
                 settle: Callable[[], Awaitable[None]] | None = None, flush_s: float = 0.1) -> None:
        self.store, self.series, self.clock, self.settle, self.flush_s = store, metrics.agents, clock, settle, flush_s
        self.counters: CohortCounts | None = None

    async def report(self, tenant: str, session_ids: list[str], outcome: Outcome, *,
                     wait: bool = True) -> Summary | None:
        """The first of `session_ids` the tenant has a recorded session of gets the outcome; None when it has
        none of them (nothing is written). Raises StoreError when the store does not answer."""
        outcome = replace(outcome, at=self.clock())
        if wait and self.settle is not None:
            await self.settle()
        found = await self._write(tenant, session_ids, outcome)
        if found is None and wait:
            await asyncio.sleep(self.flush_s * 2)  # the steps may sit in another replica's queue
            found = await self._write(tenant, session_ids, outcome)
        return found

    async def _write(self, tenant: str, session_ids: list[str], outcome: Outcome) -> Summary | None:
        for session_id in session_ids:
            written = await self.store.set_outcome((tenant, session_id), outcome)
            if written is not None:
                summary, replaced = written
                self._count(summary, replaced)
                return summary
        return None

    def _count(self, summary: Summary, replaced: Outcome | None) -> None:
        outcome = summary.outcome
        assert outcome is not None
        membership = summary.membership
        route = summary.route or "none"
        if replaced is None:
            labels = (route, mix(summary.deployments), membership.cohort if membership else "none", outcome.word)
            self.series.outcomes.labels(*labels).inc()
            self.series.outcome_cost.labels(*labels).inc(outcome.cost_usd)
            self.series.outcome_steps.labels(*labels).inc(outcome.steps)
        else:
            self.series.outcomes_replaced.labels(route, replaced.word, outcome.word).inc()
        if self.counters is None:
            return
        if replaced is not None:  # the earlier report's counts are taken back where they were given
            self._to_cohort(replaced, -1)
        self._to_cohort(outcome, 1)

    def _to_cohort(self, outcome: Outcome, sign: int) -> None:
        membership = Membership.decode(outcome.rollout) if outcome.rollout else None
        if membership is None or self.counters is None or membership.cohort not in Cohort._value2member_map_:
            return
        fields = outcome_fields(Cohort(membership.cohort), OutcomeSample(outcome.success, outcome.cost_usd), sign)
        self.counters.count_outcome(membership.rollout_id, membership.run, membership.window, fields)
