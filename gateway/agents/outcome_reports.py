"""Task outcomes at run time: a report (from the outcome API or a step's `x-session-outcome` header) written
to the session's record, counted in the outcome metrics and, for a session measured in a rollout cohort,
in that cohort's counters the task_success_rate and cost_per_success guards judge."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from gateway.agents.outcomes import Membership, Outcome, mix
from gateway.agents.trajectory import Summary
from gateway.rollout.samples import Cohort, OutcomeSample, outcome_fields
from gateway.store.trajectories import Ref, TrajectoryStore
from gateway.telemetry import metrics as t


class CohortCounts(Protocol):
    """Where a session's outcome counts toward its rollout's guards (experiments.rollout_counters.RolloutCounters)."""

    def count_outcome(self, rollout_id: str, run: int, window: int, fields: dict[str, int]) -> None: ...


class Outcomes:
    """Writes reports and counts them; `counters` is wired once the experiments exist (None: no rollouts).

    An agent reports right after its last step, before the recorder has written that step: the outcome API
    finds the session with Trajectories.locate(settled=True), which first writes this process's queued steps
    (so the outcome is given the spend and steps of the run's last step too) and waits for another replica's.
    """

    def __init__(self, store: TrajectoryStore, metrics: t.Metrics, clock: Callable[[], float] = time.time) -> None:
        self.store, self.series, self.clock = store, metrics.agents, clock
        self.counters: CohortCounts | None = None

    async def report(self, ref: Ref, outcome: Outcome) -> Summary | None:
        """The recorded session's outcome, written and counted; None when it is not (or no longer) recorded
        (nothing is written). Raises StoreError when the store does not answer."""
        written = await self.store.set_outcome(ref, replace(outcome, at=self.clock()))
        if written is None:
            return None
        summary, replaced = written
        self._count(summary, replaced)
        return summary

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
