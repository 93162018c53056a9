"""The shadow pair store contract, run against redis-server and the in-memory twin; the Redis keys it keeps."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.store.pairs import MemoryShadowPairStore, RedisShadowPairStore, ShadowPairStore
from tests.fixtures.redis_server import RedisServer


@pytest.fixture(params=["memory", "redis"])
async def store(request: Any, key_prefix: str) -> AsyncIterator[ShadowPairStore]:
    if request.param == "memory":
        yield MemoryShadowPairStore()
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    found = RedisShadowPairStore(server.url, timeout_s=1.0, prefix=key_prefix)
    yield found
    await found.close()


async def test_pairs_come_back_oldest_first_by_target(store: ShadowPairStore) -> None:
    for i in range(5):
        await store.add_pair("deployment:a" if i % 2 else "deployment:b", json.dumps({"i": i}), 1000)
    assert [json.loads(r)["i"] for r in await store.pairs(None, 100)] == [0, 1, 2, 3, 4]
    assert [json.loads(r)["i"] for r in await store.pairs("deployment:a", 100)] == [1, 3]
    assert [json.loads(r)["i"] for r in await store.pairs(None, 2)] == [3, 4]


async def test_a_target_keeps_its_newest_pairs(store: ShadowPairStore) -> None:
    for i in range(5):
        await store.add_pair("deployment:a", json.dumps({"i": i}), 3)
    found = [json.loads(r)["i"] for r in await store.pairs("deployment:a", 100)]
    assert found[-3:] == [2, 3, 4] and len(found) <= 5  # Redis trims approximately (MAXLEN ~)
    assert await store.pairs("deployment:none", 100) == []


@pytest.mark.redis
async def test_pairs_stay_under_their_keys(redis_server: RedisServer, key_prefix: str) -> None:
    """A running deployment's pairs stay readable: the streams are those earlier versions wrote."""
    store = RedisShadowPairStore(redis_server.url, prefix=key_prefix)
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        await client.xadd(f"{key_prefix}:shadow:pairs:*", {"r": '{"i":0}'})  # as written before
        await store.add_pair("deployment:a", '{"i":1}', 100)
        assert await store.pairs(None, 10) == ['{"i":0}', '{"i":1}']
        assert await client.xlen(f"{key_prefix}:shadow:pairs:deployment:a") == 1
    finally:
        await client.aclose()
        await store.close()
