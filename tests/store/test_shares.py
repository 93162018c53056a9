"""The share window store contract, run against redis-server and the in-memory twin; the Redis key it keeps."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.store.shares import MemoryShareWindowStore, RedisShareWindowStore, ShareWindowStore
from tests.fixtures.redis_server import RedisServer


@pytest.fixture(params=["memory", "redis"])
async def store(request: Any, key_prefix: str) -> AsyncIterator[ShareWindowStore]:
    if request.param == "memory":
        yield MemoryShareWindowStore()
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    found = RedisShareWindowStore(server.url, timeout_s=1.0, prefix=key_prefix)
    yield found
    await found.close()


async def test_a_window_keeps_the_newest_scores_of_its_route(store: ShareWindowStore) -> None:
    assert await store.share_window("auto", [], 3) == []
    assert await store.share_window("auto", [0.1, 0.2], 3) == pytest.approx([0.1, 0.2])
    assert await store.share_window("auto", [0.3, 0.4], 3) == pytest.approx([0.2, 0.3, 0.4])
    assert await store.share_window("auto", [], 3) == pytest.approx([0.2, 0.3, 0.4])  # a read only
    assert await store.share_window("other", [0.9], 3) == pytest.approx([0.9])


@pytest.mark.redis
async def test_two_replicas_share_one_window(redis_server: RedisServer, key_prefix: str) -> None:
    a = RedisShareWindowStore(redis_server.url, prefix=key_prefix)
    b = RedisShareWindowStore(redis_server.url, prefix=key_prefix)
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        await a.share_window("auto", [0.1], 10)
        assert await b.share_window("auto", [0.5], 10) == pytest.approx([0.1, 0.5])
        assert await client.lrange(f"{key_prefix}:share:scores:auto", 0, -1) == ["0.1", "0.5"]  # the key as before
    finally:
        await client.aclose()
        await a.close()
        await b.close()
