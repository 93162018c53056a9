"""A request's rollout arm: an agent session keeps its arm for its whole trajectory."""

from __future__ import annotations

import dataclasses

import pytest
import redis.asyncio as aioredis

from gateway.experiments.session_arms import ARM_TTL_S, SessionArms
from gateway.rollout.state import Arm
from gateway.rollout.step import start
from gateway.store.rollout_memory import MemoryRolloutStore
from gateway.store.rollouts import RedisRolloutStore, RolloutKeys
from tests.fixtures.redis_server import RedisServer

SESSION = "header:x-session-id=agent-7"


@pytest.mark.redis
async def test_each_step_of_a_session_renews_its_arm(redis_server: RedisServer, key_prefix: str) -> None:
    """The arm lapses ARM_TTL_S after the session's last step, not after its first (a long agent run
    would otherwise be reassigned, possibly to the other arm, mid-trajectory)."""
    store = RedisRolloutStore(redis_server.url, timeout_s=1.0, prefix=key_prefix)
    client = aioredis.Redis.from_url(redis_server.url)
    arms = SessionArms(store, RolloutKeys(key_prefix))
    state = dataclasses.replace(start("r1", 0.0), weight_pct=50.0)
    key = arms.keys.arm(state.rollout_id, state.run, SESSION)
    try:
        first = await arms.arm(state, SESSION)
        await arms.renew()
        assert ARM_TTL_S - 60 < await client.ttl(key) <= ARM_TTL_S
        await client.expire(key, 5)  # as if the session's first step were almost an hour ago
        again = await arms.arm(state, SESSION)  # a later step, answered from this replica's cache
        await arms.renew()
        assert again == first
        assert await client.ttl(key) > ARM_TTL_S - 60
    finally:
        await client.aclose()
        await store.close()


async def test_a_session_keeps_the_arm_another_replica_recorded_first() -> None:
    store, keys = MemoryRolloutStore(), RolloutKeys("ag")
    state = dataclasses.replace(start("r1", 0.0), weight_pct=50.0)
    mine = await SessionArms(store, keys).arm(state, SESSION)
    other = SessionArms(store, keys)  # a second replica, its cache empty
    for weight in (1.0, 99.0):  # whatever weight the other replica serves by, the first arm holds
        assert (await other.arm(dataclasses.replace(state, weight_pct=weight), SESSION)).arm is mine.arm


async def test_a_request_without_a_session_is_bucketed_and_not_recorded() -> None:
    store, keys = MemoryRolloutStore(), RolloutKeys("ag")
    state = dataclasses.replace(start("r1", 0.0), weight_pct=30.0)  # candidate [0, 30), control [30, 60)
    arms = SessionArms(store, keys)
    users = [f"user=u{i}" for i in range(40)]
    found = {(await arms.arm(state, user)).arm for user in users}
    assert found == {Arm.CANDIDATE, Arm.CONTROL, Arm.STABLE}  # by bucket, not by session
    for user in users:  # nothing recorded: the store takes any first value
        assert await store.record_arm(keys.arm(state.rollout_id, state.run, user), "x", 60) == "x"
    assert (await arms.arm(state, None)).arm is Arm.STABLE  # unkeyed: never put at risk
