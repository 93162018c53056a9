"""A replica's view of the rollout states: served from without I/O, fresh only while it keeps reading, and
decoded once a read."""

from __future__ import annotations

import asyncio
import dataclasses

from gateway.experiments.rollout_view import STALE_AFTER_S, RolloutView
from gateway.policy.model import Policy
from gateway.rollout.step import abort, start
from gateway.store.rollout_memory import MemoryRolloutStore
from gateway.telemetry.metrics import make_metrics
from tests.fixtures.conditions import until
from tests.fixtures.enrolled import policy_of

ROLLOUT = {"rollouts": [{"id": "r1", "route": "hq", "candidate": "deployment:hq-v2", "stable": "deployment:hq",
                         "steps": [{"set_weight": 50}]}]}


def _policy() -> Policy:
    return policy_of(ROLLOUT)


async def test_the_view_serves_its_rollouts_state_only_while_fresh() -> None:
    store, policy = MemoryRolloutStore(), _policy()
    view = RolloutView(store, lambda: policy, make_metrics())
    spec = view.index(policy).rollouts["hq"]
    state = dataclasses.replace(start("r1", 1.0), weight_pct=50.0)
    await store.write_state("hq", -1, state, 0)
    assert view.state(spec) is None and not view.fresh()  # never read: serve stable
    await view.refresh()
    assert view.state(spec) == state and view.fresh()
    view.synced_at -= STALE_AFTER_S  # as if the store had not answered since
    assert view.state(spec) is None and view.known("hq") == state  # stale: stable, but still known


async def test_another_rollouts_state_is_known_but_not_served() -> None:
    store, policy = MemoryRolloutStore(), _policy()
    view = RolloutView(store, lambda: policy, make_metrics())
    await store.write_state("hq", -1, start("old", 1.0), 0)
    await view.refresh()
    assert view.state(view.index(policy).rollouts["hq"]) is None
    assert view.known("hq") == start("old", 1.0)


async def test_the_view_follows_each_announced_change() -> None:
    store, policy = MemoryRolloutStore(), _policy()
    view = RolloutView(store, lambda: policy, make_metrics())
    first = start("r1", 1.0)
    await store.write_state("hq", -1, first, 0)
    task = asyncio.get_running_loop().create_task(view.follow())
    try:
        await until(lambda: view.known("hq") == first, what="the first read")
        aborted = abort(first, actor="ops", reason="", generation=first.generation, now=2.0)
        await store.write_state("hq", first.generation, aborted, 0)  # another replica's write, announced
        await until(lambda: view.known("hq") == aborted, what="the change followed")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_the_index_is_built_once_per_policy() -> None:
    policy = _policy()
    view = RolloutView(MemoryRolloutStore(), lambda: policy, make_metrics())
    assert view.index(policy) is view.index(policy)
    assert list(view.index(policy).rollouts) == ["hq"]
