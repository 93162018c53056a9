"""The rollouts runtime as the request path and the admin API use it: counts flushed into the leader's abort,
and what is still pending written on close."""

from __future__ import annotations

import dataclasses

from gateway.experiments.rollouts import Rollouts
from gateway.policy.model import Policy
from gateway.rollout.samples import Cohort, Sample
from gateway.rollout.state import Phase
from gateway.store.rollout_memory import MemoryRolloutStore
from gateway.telemetry.metrics import make_metrics
from tests.fixtures.enrolled import policy_of

ROLLOUT = {"rollouts": [{"id": "r1", "route": "hq", "candidate": "deployment:hq-v2", "stable": "deployment:hq",
                         "guards": {"error_rate": {"slo": 0.05}}, "steps": [{"set_weight": 50}, {"pause": {}}]}]}


def _policy() -> Policy:
    return policy_of(ROLLOUT)


async def test_a_flush_that_proves_a_breach_aborts_the_rollout_served_by() -> None:
    store, policy = MemoryRolloutStore(), _policy()
    rollouts = Rollouts(store, lambda: policy, make_metrics())
    spec = rollouts.view.index(policy).rollouts["hq"]
    await rollouts.leader.tick()  # started
    await rollouts.leader.tick()  # at 50 %
    await rollouts.view.refresh()
    state = rollouts.view.state(spec)
    assert state is not None and state.weight_pct == 50.0
    for i in range(200):
        rollouts.counters.record("hq", spec, state, Cohort.CANDIDATE, Sample(i % 2 == 0, 10, 50.0, None))
    await rollouts.flush()
    aborted = await rollouts.leader.current("hq", spec)
    assert aborted.phase is Phase.ABORTED
    assert "error_rate_slo" in aborted.history[-1].reason


async def test_close_writes_the_counts_still_pending() -> None:
    store, policy = MemoryRolloutStore(), _policy()
    rollouts = Rollouts(store, lambda: policy, make_metrics())
    spec = rollouts.view.index(policy).rollouts["hq"]
    state = dataclasses.replace(await rollouts.leader.current("hq", spec), weight_pct=50.0)
    rollouts.counters.record("hq", spec, state, Cohort.CONTROL, Sample(False, 10, 50.0, None))
    await rollouts.close()
    assert (await rollouts.counters.observe(state)).control.requests == 1
