"""The label store contract, run against redis-server and the in-memory twin; the Redis key it keeps."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.store.labels import LabelStore, MemoryLabelStore, RedisLabelStore
from tests.fixtures.redis_server import RedisServer


@pytest.fixture(params=["memory", "redis"])
async def store(request: Any, key_prefix: str) -> AsyncIterator[LabelStore]:
    if request.param == "memory":
        yield MemoryLabelStore()
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    found = RedisLabelStore(server.url, timeout_s=1.0, prefix=key_prefix)
    yield found
    await found.close()


async def test_labels_are_bounded_and_expire(store: LabelStore) -> None:
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


@pytest.mark.redis
async def test_labels_stay_under_their_key(redis_server: RedisServer, key_prefix: str) -> None:
    """A running deployment's labels stay readable: the stream is the one earlier versions wrote."""
    store = RedisLabelStore(redis_server.url, prefix=key_prefix)
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        await client.xadd(f"{key_prefix}:shadow:labels", {"r": '{"i":0}'})  # as written before
        await store.add_label('{"i":1}', 100, 60)
        assert await store.labels(10) == ['{"i":0}', '{"i":1}']
    finally:
        await client.aclose()
        await store.close()
