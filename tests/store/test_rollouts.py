"""The rollout store contract, one table run against redis-server and the in-memory twin; shadow helpers."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.experiments.shadows import BREAKER_FAILURES, Breaker, shadow_body
from gateway.rollout.samples import Observations
from gateway.rollout.step import RolloutState, abort, start
from gateway.store.contract import StoreError
from gateway.store.memory import MemoryRolloutStore
from gateway.store.rollouts import RedisRolloutStore, RolloutStore
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


def _json(state: RolloutState) -> str:
    return json.dumps(state.to_dict())


async def test_state_is_written_only_by_compare_and_set(store: RolloutStore) -> None:
    first = start("r1", 100.0)
    assert await store.read_state("hq") is None
    assert await store.write_state("hq", -1, _json(first), 0)
    assert not await store.write_state("hq", -1, _json(first), 0)  # exists already
    aborted = abort(first, actor="a", reason="r", generation=first.generation, now=101.0)
    assert not await store.write_state("hq", first.generation + 5, _json(aborted), 0)
    assert await store.write_state("hq", first.generation, _json(aborted), 0)
    raw = await store.read_state("hq")
    assert raw is not None and RolloutState.from_dict(json.loads(raw)) == aborted


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


async def test_pairs_come_back_oldest_first_by_target(store: RolloutStore) -> None:
    for i in range(5):
        await store.add_pair("deployment:a" if i % 2 else "deployment:b", json.dumps({"i": i}), 1000)
    assert [json.loads(r)["i"] for r in await store.pairs(None, 100)] == [0, 1, 2, 3, 4]
    assert [json.loads(r)["i"] for r in await store.pairs("deployment:a", 100)] == [1, 3]
    assert [json.loads(r)["i"] for r in await store.pairs(None, 2)] == [3, 4]


async def test_a_written_state_is_announced(store: RolloutStore) -> None:
    changes = store.changes()
    # The first item comes once the subscription is live (a change, or None after a quiet second).
    assert await asyncio.wait_for(anext(changes), 5.0) is None
    await store.write_state("auto", -1, _json(start("r2", 1.0)), 0)
    assert await asyncio.wait_for(_next_route(changes), 5.0) == "auto"
    await changes.aclose()


async def _next_route(changes: AsyncIterator[str | None]) -> str:
    async for route in changes:
        if route is not None:
            return route
    raise AssertionError("no change announced")


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
        assert await a.write_state("hq", -1, _json(state), token)
        # a stops renewing: once its lock expires (0.3 s), b takes the lead with a newer token
        await until(lambda: b.lead("b", 5.0), what="the lock passed to b", every_s=0.05)
        newer = await b.lead("b", 5.0)  # renewal: the same token
        assert newer is not None and newer > token
        stepped = abort(state, actor="t", reason="r", generation=state.generation, now=2.0)
        assert not await a.write_state("hq", state.generation, _json(stepped), token)  # fenced off
        assert await b.write_state("hq", state.generation, _json(stepped), newer)
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


def test_shadow_body_strips_state_and_caps_tokens() -> None:
    body = {
        "model": "m",
        "messages": [],
        "store": True,
        "metadata": {"a": 1},
        "max_tokens": 4000,
        "max_completion_tokens": 10,
        "stream": True,
        "previous_response_id": "x",
    }
    out = shadow_body(body, 256)
    assert out == {
        "model": "m",
        "messages": [],
        "max_tokens": 256,
        "max_completion_tokens": 10,
        "stream": True,
    }
    assert shadow_body({"model": "m"}, 64)["max_tokens"] == 64


def test_breaker_opens_after_failures_then_lets_one_probe_through() -> None:
    breaker = Breaker()
    for _ in range(BREAKER_FAILURES):
        assert breaker.allows(0.0)
        breaker.record(False, 0.0)
    assert not breaker.allows(1.0)
    assert breaker.allows(100.0) and not breaker.allows(100.0)  # half-open: a single probe
    breaker.record(True, 100.0)
    assert breaker.allows(100.0)


async def test_the_memory_rollout_store_expires_arms_and_counters_and_bounds_the_arms() -> None:
    now = [1_000.0]
    store = MemoryRolloutStore(clock=lambda: now[0], max_keys=1000)
    assert await store.record_arm("ag:ro:arm:r:1:s1", "candidate", 3600) == "candidate"
    assert await store.record_arm("ag:ro:arm:r:1:s1", "stable", 3600) == "candidate"  # kept for its TTL
    await store.count("ag:ro:n:r:1:0", {"candidate.requests": 2}, 7 * 86400)
    now[0] += 3601
    assert await store.record_arm("ag:ro:arm:r:1:s1", "stable", 3600) == "stable"  # expired, as in Redis
    assert await store.counts("ag:ro:n:r:1:0") == {"candidate.requests": 2}
    now[0] += 7 * 86400
    assert await store.counts("ag:ro:n:r:1:0") == {}
    for i in range(5000):
        await store.record_arm(f"ag:ro:arm:r:1:k{i}", "stable", 3600)
    assert len(store._ks.data) <= 1000 + 1


async def test_labels_are_bounded_and_expire(store: RolloutStore) -> None:
    for i in range(5):
        await store.add_label(json.dumps({"i": i}), 3, 60)
    assert [json.loads(r)["i"] for r in await store.labels(100)] == [2, 3, 4]  # the newest 3, oldest first
    assert [json.loads(r)["i"] for r in await store.labels(2)] == [3, 4]
    await store.add_label(json.dumps({"i": 5}), 3, 0.2)
    expired_at = time.time() + 0.3
    while time.time() < expired_at:  # wait for the clock to pass the label's ttl (bounded)
        await asyncio.sleep(0.05)
    await store.add_label(json.dumps({"i": 6}), 3, 0.2)  # a ttl applies to every label older than it
    assert [json.loads(r)["i"] for r in await store.labels(100)] == [6]


async def test_a_touched_arm_lapses_a_ttl_after_its_last_touch() -> None:
    now = [1_000.0]
    store = MemoryRolloutStore(clock=lambda: now[0])
    assert await store.record_arm("ag:ro:arm:r:1:s1", "candidate", 3600) == "candidate"
    for _ in range(3):  # an agent session stepping every 50 minutes for 2.5 hours
        now[0] += 3000
        await store.touch_arms(["ag:ro:arm:r:1:s1"], 3600)
    assert await store.record_arm("ag:ro:arm:r:1:s1", "stable", 3600) == "candidate"
    now[0] += 3601
    assert await store.record_arm("ag:ro:arm:r:1:s1", "stable", 3600) == "stable"
