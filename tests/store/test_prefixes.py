"""The session prefix-cache store contract, run against redis-server and the in-memory twin."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.context.prefix import NO_PREFIXES, Chain, SessionPrefixes
from gateway.store.prefixes import MemoryPrefixStore, PrefixStore, RedisPrefixStore, Served, prefixes_key
from tests.fixtures.redis_server import RedisServer

ONE = Chain.of([("aa", 100), ("bb", 900)])
TWO = Chain.of([("aa", 100), ("bb", 900), ("cc", 1500)])


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "redis"])
async def store(request: Any, key_prefix: str) -> AsyncIterator[PrefixStore]:
    if request.param == "memory":
        yield MemoryPrefixStore()
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    found = RedisPrefixStore(server.url, timeout_s=1.0, prefix=key_prefix)
    yield found
    await found.close()


async def test_a_session_without_a_record_reads_as_none(store: PrefixStore) -> None:
    assert await store.prefixes("t", "s1") == NO_PREFIXES


async def test_each_deployment_keeps_the_last_prompt_it_served_and_the_home_follows(store: PrefixStore) -> None:
    await store.served("t", "s1", "fast", ONE, 3600)
    assert await store.prefixes("t", "s1") == SessionPrefixes({"fast": ONE}, "fast", 1)
    await store.served("t", "s1", "fast", TWO, 3600)
    assert await store.prefixes("t", "s1") == SessionPrefixes({"fast": TWO}, "fast", 2)
    await store.served("t", "s1", "hq", TWO, 3600)
    assert await store.prefixes("t", "s1") == SessionPrefixes({"fast": TWO, "hq": TWO}, "hq", 1)
    # another session, another tenant: their own records
    assert await store.prefixes("t", "s2") == NO_PREFIXES
    assert await store.prefixes("u", "s1") == NO_PREFIXES


async def test_a_batch_of_served_steps_is_recorded_in_order_as_one_at_a_time_would(store: PrefixStore) -> None:
    await store.served_many([Served("t", "s1", "fast", ONE, 3600), Served("t", "s2", "hq", ONE, 3600),
                             Served("t", "s1", "fast", TWO, 3600), Served("t", "s1", "hq", TWO, 3600),
                             Served("u", "s1", "fast", ONE, 3600)])
    assert await store.prefixes("t", "s1") == SessionPrefixes({"fast": TWO, "hq": TWO}, "hq", 1)
    assert await store.prefixes("t", "s2") == SessionPrefixes({"hq": ONE}, "hq", 1)
    assert await store.prefixes("u", "s1") == SessionPrefixes({"fast": ONE}, "fast", 1)
    await store.served_many([])  # nothing waiting: nothing written
    assert await store.prefixes("t", "s3") == NO_PREFIXES


async def test_a_warm_up_replaces_the_deployments_chain_and_leaves_the_home(store: PrefixStore) -> None:
    await store.served("t", "s1", "fast", TWO, 3600)
    await store.served("t", "s1", "fast", TWO, 3600)
    await store.warmed("t", "s1", "hq", TWO, 3600)
    assert await store.prefixes("t", "s1") == SessionPrefixes({"fast": TWO, "hq": TWO}, "fast", 2, frozenset({"hq"}))
    # once hq serves a step, what it holds is that step's prompt, no longer a warm-up's
    await store.served("t", "s1", "hq", TWO, 3600)
    assert await store.prefixes("t", "s1") == SessionPrefixes({"fast": TWO, "hq": TWO}, "hq", 1)


async def test_the_memory_twin_forgets_an_idle_session_and_keeps_its_bound() -> None:
    clock = Clock()
    store = MemoryPrefixStore(max_sessions=2, clock=clock)
    await store.served("t", "s1", "fast", ONE, 60)
    clock.now += 61
    assert await store.prefixes("t", "s1") == NO_PREFIXES
    for name in ("a", "b", "c"):
        await store.served("t", name, "fast", ONE, 60)
    assert await store.prefixes("t", "a") == NO_PREFIXES  # the least recently served went first
    assert (await store.prefixes("t", "c")).home == "fast"


@pytest.mark.redis
async def test_two_replicas_read_one_record_that_expires(redis_server: RedisServer, key_prefix: str) -> None:
    a = RedisPrefixStore(redis_server.url, prefix=key_prefix)
    b = RedisPrefixStore(redis_server.url, prefix=key_prefix)
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        await a.served("t", "s1", "fast", ONE, 120)
        await b.served("t", "s1", "hq", TWO, 120)
        assert await a.prefixes("t", "s1") == SessionPrefixes({"fast": ONE, "hq": TWO}, "hq", 1)
        key = prefixes_key(key_prefix, "t", "s1")
        assert 0 < await client.ttl(key) <= 120
        assert await client.hget(key, "c:fast") == "aa:100,bb:900"
    finally:
        await client.aclose()
        await a.close()
        await b.close()
