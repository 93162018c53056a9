"""The rollout store contract (states by CAS, counters, arms, the change feed), one table run against
redis-server and the in-memory twin; the Redis keys a running deployment's data lives under."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.rollout.samples import Observations
from gateway.rollout.step import abort, start
from gateway.store.contract import StoreError
from gateway.store.rollout_memory import MemoryRolloutStore
from gateway.store.rollouts import RedisRolloutStore, RolloutKeys, RolloutStore
from tests.fixtures.conditions import until
from tests.fixtures.redis_server import RedisServer


@pytest.fixture(params=["memory", "redis"])
async def store(request: Any, key_prefix: str) -> AsyncIterator[RolloutStore]:
    if request.param == "memory":
        yield MemoryRolloutStore()
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    found = RedisRolloutStore(server.url, timeout_s=1.0, prefix=key_prefix)
    yield found
    await found.close()


async def test_state_is_written_only_by_compare_and_set(store: RolloutStore) -> None:
    first = start("r1", 100.0)
    assert await store.read_state("hq") is None
    assert await store.write_state("hq", -1, first, 0)
    assert not await store.write_state("hq", -1, first, 0)  # exists already
    aborted = abort(first, actor="a", reason="r", generation=first.generation, now=101.0)
    assert not await store.write_state("hq", first.generation + 5, aborted, 0)
    assert await store.write_state("hq", first.generation, aborted, 0)
    assert await store.read_state("hq") == aborted


async def test_counters_return_totals_and_rebuild_observations(store: RolloutStore) -> None:
    assert await store.count("k", {"candidate.requests": 2, "candidate.errors": 1}, 60) == {
        "candidate.requests": 2,
        "candidate.errors": 1,
    }
    assert await store.count("k", {"candidate.requests": 3}, 60) == {"candidate.requests": 5}
    obs = Observations.from_counts(await store.counts("k"))
    assert (obs.candidate.requests, obs.candidate.errors) == (5, 1)


async def test_first_recorded_arm_wins(store: RolloutStore) -> None:
    assert await store.record_arm("arm:s1", "0|candidate|r1", 60) == "0|candidate|r1"
    assert await store.record_arm("arm:s1", "0|stable|r1", 60) == "0|candidate|r1"


async def test_a_written_state_is_announced(store: RolloutStore) -> None:
    changes = store.changes()
    # The first item comes once the subscription is live (a change, or None after a quiet second).
    assert await asyncio.wait_for(anext(changes), 5.0) is None
    await store.write_state("auto", -1, start("r2", 1.0), 0)
    assert await asyncio.wait_for(_next_route(changes), 5.0) == "auto"
    await changes.aclose()


async def _next_route(changes: AsyncIterator[str | None]) -> str:
    async for route in changes:
        if route is not None:
            return route
    raise AssertionError("no change announced")


@pytest.mark.redis
async def test_a_state_stays_under_its_key_as_json(redis_server: RedisServer, key_prefix: str) -> None:
    """A running deployment's states stay readable: the key and the JSON are those earlier versions wrote."""
    store = RedisRolloutStore(redis_server.url, prefix=key_prefix)
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        state = start("r1", 1.0)
        await client.set(f"{key_prefix}:ro:state:hq", json.dumps(state.to_dict()))  # as written before
        assert await store.read_state("hq") == state
        stepped = abort(state, actor="t", reason="r", generation=state.generation, now=2.0)
        assert await store.write_state("hq", state.generation, stepped, 0)
        assert json.loads(await client.get(f"{key_prefix}:ro:state:hq")) == stepped.to_dict()
        keys = RolloutKeys(key_prefix)
        assert (keys.lock(), keys.fence(), keys.samples("r1", 0, 2)) == (
            f"{key_prefix}:ro:lock", f"{key_prefix}:ro:fence", f"{key_prefix}:ro:n:r1:0:2")
        assert keys.arm("r1", 0, "session=s1").startswith(f"{key_prefix}:ro:arm:r1:0:")
    finally:
        await client.aclose()
        await store.close()


@pytest.mark.redis
async def test_one_leader_and_fencing_tokens_that_only_grow(
    redis_server: RedisServer,
    key_prefix: str,
) -> None:
    a = RedisRolloutStore(redis_server.url, prefix=key_prefix)
    b = RedisRolloutStore(redis_server.url, prefix=key_prefix)
    try:
        token = await a.lead("a", 0.3)
        assert token is not None and await b.lead("b", 0.3) is None
        assert await a.lead("a", 0.3) == token  # renewal keeps the token
        state = start("r1", 1.0)
        assert await a.write_state("hq", -1, state, token)
        # a stops renewing: once its lock expires (0.3 s), b takes the lead with a newer token
        await until(lambda: b.lead("b", 5.0), what="the lock passed to b", every_s=0.05)
        newer = await b.lead("b", 5.0)  # renewal: the same token
        assert newer is not None and newer > token
        stepped = abort(state, actor="t", reason="r", generation=state.generation, now=2.0)
        assert not await a.write_state("hq", state.generation, stepped, token)  # fenced off
        assert await b.write_state("hq", state.generation, stepped, newer)
    finally:
        await a.close()
        await b.close()


@pytest.mark.redis
async def test_unreachable_redis_raises_store_error(private_redis: RedisServer) -> None:
    store = RedisRolloutStore(private_redis.url, timeout_s=0.2)
    private_redis.kill()
    with pytest.raises(StoreError):
        await store.read_state("hq")
    await store.close()
