"""The writes of rollout state: the leader's tick, the instant abort and the manual operations, all by CAS; a read
for the admin API writes nothing."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.experiments.rollout_counters import RolloutCounters
from gateway.experiments.rollout_leader import RolloutLeader
from gateway.experiments.rollout_view import RolloutView
from gateway.policy.model import Policy
from gateway.rollout.spec import RolloutSpec
from gateway.rollout.state import Phase, RolloutState, StaleGeneration
from gateway.rollout.step import abort, pause, start
from gateway.store.rollout_memory import MemoryRolloutStore
from gateway.store.rollouts import RolloutKeys
from gateway.telemetry.metrics import make_metrics
from tests.fixtures.enrolled import policy_of
from tests.fixtures.rollout_scripts import spec_of


def _rollout(rollout_id: str) -> dict[str, Any]:
    return {"id": rollout_id, "route": "hq", "candidate": "deployment:hq-v2", "stable": "deployment:hq",
            "guards": {"error_rate": {"slo": 0.05}}, "steps": [{"set_weight": 50}, {"pause": {}}]}


def _policy(rollout_id: str) -> Policy:
    return policy_of({"rollouts": [_rollout(rollout_id)]})


def _leader(store: MemoryRolloutStore, policy: Policy, now: float = 100.0) -> tuple[RolloutLeader, RolloutView]:
    metrics = make_metrics()
    view = RolloutView(store, lambda: policy, metrics)
    leader = RolloutLeader(store, view, RolloutCounters(store, RolloutKeys("ag")), lambda: policy, metrics,
                           clock=lambda: now)
    return leader, view


def _spec(policy: Policy) -> RolloutSpec:
    return policy.rollouts[0]


async def test_reading_a_rollout_the_ticker_has_not_started_writes_nothing() -> None:
    store, policy = MemoryRolloutStore(), _policy("r1")
    leader, _ = _leader(store, policy)
    shown = await leader.current("hq", _spec(policy))
    assert shown == start("r1", 100.0)  # as the ticker would start it
    assert await store.read_state("hq") is None  # GET /admin/rollouts/{route} is a read


async def test_a_replaced_rollout_reads_as_started_with_its_generations_counted_on() -> None:
    store, policy = MemoryRolloutStore(), _policy("r2")
    old = abort(start("r1", 1.0), actor="a", reason="", generation=1, now=2.0)
    assert await store.write_state("hq", -1, old, 0)
    leader, _ = _leader(store, policy)
    shown = await leader.current("hq", _spec(policy))
    assert (shown.rollout_id, shown.generation) == ("r2", old.generation + 1)
    assert await store.read_state("hq") == old


async def test_an_operation_on_an_unstarted_rollout_starts_and_changes_it_in_one_write() -> None:
    store, policy = MemoryRolloutStore(), _policy("r1")
    leader, view = _leader(store, policy)
    spec = _spec(policy)
    shown = await leader.current("hq", spec)
    done = await leader.operate(
        "hq", spec, lambda s: pause(s, actor="ops", reason="look", generation=shown.generation, now=100.0))
    assert done.phase is Phase.PAUSED and [t.action for t in done.history] == ["start", "pause"]
    assert await store.read_state("hq") == done and view.known("hq") == done
    with pytest.raises(StaleGeneration):  # acting on the generation read before: 409
        await leader.operate("hq", spec, lambda s: abort(s, actor="ops", reason="", generation=shown.generation,
                                                          now=101.0))


async def test_an_operation_loses_to_a_write_made_meanwhile() -> None:
    store, policy = MemoryRolloutStore(), _policy("r1")
    leader, _ = _leader(store, policy)
    first = start("r1", 1.0)
    assert await store.write_state("hq", -1, first, 0)

    def racing(state: RolloutState) -> RolloutState:  # another replica writes between the read and the write
        store._states["hq"] = abort(state, actor="other", reason="", generation=state.generation, now=2.0)
        return pause(state, actor="ops", reason="", generation=state.generation, now=2.0)

    with pytest.raises(StaleGeneration):
        await leader.operate("hq", _spec(policy), racing)
    found = await store.read_state("hq")
    assert found is not None and found.phase is Phase.ABORTED


async def test_the_leader_starts_a_new_rollout_then_steps_it() -> None:
    store, policy = MemoryRolloutStore(), _policy("r1")
    leader, view = _leader(store, policy)
    await leader.tick()
    started = await store.read_state("hq")
    assert leader.leading and started is not None and started.rollout_id == "r1"
    await leader.tick()
    stepped = await store.read_state("hq")
    assert stepped is not None and stepped.weight_pct == 50.0 and view.known("hq") == stepped


async def test_a_breach_of_the_error_slo_aborts_at_once_and_a_healthy_batch_does_not() -> None:
    store, policy = MemoryRolloutStore(), _policy("r1")
    leader, _ = _leader(store, policy)
    spec = spec_of("{steps: [{set_weight: 50}], guards: {error_rate: {slo: 0.05}}}", id="r1", route="hq")
    assert await store.write_state("hq", -1, start("r1", 1.0), 0)
    await leader.abort_on_breach("hq", spec, {"candidate.errors": 0, "candidate.requests": 400})
    healthy = await store.read_state("hq")
    assert healthy is not None and healthy.phase is Phase.PROGRESSING
    await leader.abort_on_breach("hq", spec, {"candidate.errors": 200, "candidate.requests": 400})
    aborted = await store.read_state("hq")
    assert aborted is not None and aborted.phase is Phase.ABORTED
    assert aborted.history[-1].actor == f"replica {leader.owner}"
    await leader.abort_on_breach("hq", spec, {"candidate.errors": 300, "candidate.requests": 500})  # no-op now
    assert await store.read_state("hq") == aborted
