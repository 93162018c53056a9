"""A replica's live rollouts: an agent session keeps its arm for its whole trajectory."""

from __future__ import annotations

import dataclasses

import pytest
import redis.asyncio as aioredis

from gateway.experiments.rollouts import ARM_TTL_S, Rollouts
from gateway.policy.model import Policy
from gateway.rollout.step import start
from gateway.store.rollouts import RedisRolloutStore
from gateway.telemetry.metrics import make_metrics
from tests.fixtures.redis_server import RedisServer

SESSION = "header:x-session-id=agent-7"


def _no_policy() -> Policy:
    raise AssertionError("not read here")


@pytest.mark.redis
async def test_each_step_of_a_session_renews_its_arm(redis_server: RedisServer, key_prefix: str) -> None:
    """The arm lapses ARM_TTL_S after the session's last step, not after its first (a long agent run
    would otherwise be reassigned, possibly to the other arm, mid-trajectory)."""
    store = RedisRolloutStore(redis_server.url, timeout_s=1.0, prefix=key_prefix)
    client = aioredis.Redis.from_url(redis_server.url)
    rollouts = Rollouts(store, _no_policy, make_metrics(), prefix=key_prefix)
    state = dataclasses.replace(start("r1", 0.0), weight_pct=50.0)
    key = rollouts.keys.arm(state.rollout_id, state.run, SESSION)
    try:
        first = await rollouts.arm(state, SESSION)
        await rollouts.flush()
        assert ARM_TTL_S - 60 < await client.ttl(key) <= ARM_TTL_S
        await client.expire(key, 5)  # as if the session's first step were almost an hour ago
        again = await rollouts.arm(state, SESSION)  # a later step, answered from this replica's cache
        await rollouts.flush()
        assert again == first
        assert await client.ttl(key) > ARM_TTL_S - 60
    finally:
        await client.aclose()
        await store.close()
