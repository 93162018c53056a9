"""The stored-responses contract, one table run against redis-server and the in-memory twin: kept per tenant (no
other tenant reads or deletes it), bounded per tenant and in total, expired after the TTL; opened by open_stores."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.apis.responses.stored import StoredResponse
from gateway.policy.tenancy import StorePolicy
from gateway.store.opening import open_stores
from gateway.store.response_memory import MemoryResponseStore
from gateway.store.responses import RedisResponseStore, ResponseLimits, ResponseStore
from tests.fixtures.clock import ManualClock
from tests.fixtures.conditions import until
from tests.fixtures.redis_server import RedisServer

LIMITS = ResponseLimits(ttl_s=60, max_per_tenant=3, max_total=5)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1000.0)


@pytest.fixture(params=["memory", "redis"])
async def store(request: Any, key_prefix: str, clock: ManualClock) -> AsyncIterator[ResponseStore]:
    if request.param == "memory":
        yield MemoryResponseStore(clock=clock)
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    found = RedisResponseStore(server.url, timeout_s=1.0, prefix=key_prefix)
    yield found
    await found.close()


def _record(tenant: str, response_id: str, at: float, text: str = "hi") -> StoredResponse:
    return StoredResponse(tenant, response_id, at, "h:s1", None, [{"role": "user", "content": text}],
                          {"id": response_id, "object": "response", "output": []})


async def test_a_response_is_its_tenants_only(store: ResponseStore, clock: ManualClock) -> None:
    kept = _record("acme", "resp_1", clock())
    await store.put(kept, LIMITS)
    assert await store.get("acme", "resp_1") == kept
    assert await store.get("globex", "resp_1") is None  # as if it did not exist
    assert not await store.delete("globex", "resp_1")
    assert await store.get("acme", "resp_1") == kept
    assert await store.delete("acme", "resp_1")
    assert await store.get("acme", "resp_1") is None and not await store.delete("acme", "resp_1")


async def test_the_oldest_go_first_over_the_tenants_bound_and_the_total(
    store: ResponseStore, clock: ManualClock
) -> None:
    for i in range(5):
        clock.now += 1
        await store.put(_record("acme", f"resp_a{i}", clock()), LIMITS)
    assert [await store.get("acme", f"resp_a{i}") is not None for i in range(5)] == [False, False, True, True, True]
    for i in range(3):
        clock.now += 1
        await store.put(_record("globex", f"resp_g{i}", clock()), LIMITS)
    kept = [await store.get("acme", f"resp_a{i}") is not None for i in range(2, 5)]
    kept += [await store.get("globex", f"resp_g{i}") is not None for i in range(3)]
    assert kept == [False, True, True, True, True, True]  # five in total: acme's oldest went


async def test_a_response_expires_after_the_ttl(store: ResponseStore, clock: ManualClock) -> None:
    if isinstance(store, RedisResponseStore):
        limits = ResponseLimits(ttl_s=1, max_per_tenant=3, max_total=5)
        await store.put(_record("acme", "resp_1", clock()), limits)
        assert await store.get("acme", "resp_1") is not None
        await until(lambda: _gone(store), timeout_s=5, what="the record's TTL")
        return
    await store.put(_record("acme", "resp_1", clock()), LIMITS)
    clock.now += 59
    assert await store.get("acme", "resp_1") is not None
    clock.now += 1
    assert await store.get("acme", "resp_1") is None


async def _gone(store: RedisResponseStore) -> bool:
    return await store.get("acme", "resp_1") is None


async def test_the_memory_store_is_bounded_in_bytes(clock: ManualClock) -> None:
    store = MemoryResponseStore(clock=clock)
    limits = ResponseLimits(ttl_s=60, max_per_tenant=100, max_total=100, max_memory_bytes=10_000)
    for i in range(10):
        await store.put(_record("acme", f"resp_{i}", clock(), "x" * 2_000), limits)
    kept = [i for i in range(10) if await store.get("acme", f"resp_{i}") is not None]
    assert kept == [6, 7, 8, 9]


async def test_open_stores_opens_the_responses_store_in_memory_and_in_redis(redis_server: RedisServer) -> None:
    embedded = open_stores(StorePolicy())
    assert isinstance(embedded.responses, MemoryResponseStore)
    shared = open_stores(StorePolicy(redis_url=redis_server.url), prefix="t-open")
    try:
        assert isinstance(shared.responses, RedisResponseStore)
        await shared.responses.put(_record("acme", "resp_1", 1.0e9), LIMITS)
        assert await shared.responses.get("acme", "resp_1") is not None
    finally:
        await shared.close()
        await embedded.close()
