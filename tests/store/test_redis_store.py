"""Redis-only behaviour: several replicas on one Redis, a Redis that dies, hangs and comes back."""

from __future__ import annotations

import asyncio
import multiprocessing
import random
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest

from gateway.accounting.budgets import Budgets
from gateway.apis.usage import Usage
from gateway.decision.admission import Cost
from gateway.errors import RateLimited, StoreUnavailable
from gateway.policy.tenancy import Budget, SessionPolicy, TenantPolicy, Window
from gateway.store.contract import Hold, Reservation, Spend, StoreError
from gateway.store.fallback import FallbackStore
from gateway.store.memory import MemoryStore
from gateway.store.redis_store import RedisStore
from tests.fixtures.conditions import until
from tests.fixtures.redis_server import RedisServer

pytestmark = pytest.mark.redis

WORST = Cost(0.05, 500)
POLICY = TenantPolicy(
    name="acme",
    budgets=(Budget(window=Window.DAY, hard_usd=1.0),),
    max_concurrent=25,
    requests_per_minute=280,
)


async def _replica(url: str, prefix: str, n: int, start_at: float, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    store = RedisStore(url, timeout_s=2.0, prefix=prefix)
    budgets = Budgets(store)
    await asyncio.sleep(max(0.0, start_at - time.time()))

    async def one() -> dict[str, Any]:
        await asyncio.sleep(rng.uniform(0, 1.0))  # arrivals spread so that settles free budget for later ones
        try:
            held = await budgets.reserve("acme", POLICY, "hq", WORST)
        except RateLimited as exc:
            return {"ok": False, "code": exc.code, "retry_after_s": exc.retry_after_s,
                    "header": exc.headers.get("Retry-After"), "message": exc.message}  # fmt: skip
        concurrent = (await store.snapshot("acme")).concurrent
        await asyncio.sleep(rng.uniform(0, 0.02))
        actual = round(WORST.usd * rng.uniform(0.3, 1.0), 9)
        await store.settle(held, Spend(actual, 100, 200))
        return {"ok": True, "usd": actual, "concurrent": concurrent}

    try:
        return list(await asyncio.gather(*(one() for _ in range(n))))
    finally:
        await store.close()


def replica_process(url: str, prefix: str, n: int, start_at: float, seed: int) -> list[dict[str, Any]]:
    """One gateway replica's budget traffic, in its own process with its own Redis connections."""
    return asyncio.run(_replica(url, prefix, n, start_at, seed))


def test_300_concurrent_reservations_from_three_processes_never_overspend(
    redis_server: RedisServer,
    key_prefix: str,
) -> None:
    ctx = multiprocessing.get_context("spawn")
    start_at = time.time() + 3.0  # all three processes start firing together
    with ProcessPoolExecutor(3, mp_context=ctx) as pool:
        futures = [
            pool.submit(replica_process, redis_server.url, key_prefix, 100, start_at, i) for i in range(3)
        ]
        results = [r for f in futures for r in f.result(timeout=120)]
    assert len(results) == 300
    admitted = [r for r in results if r["ok"]]
    refused = [r for r in results if not r["ok"]]
    assert admitted and refused
    for r in refused:
        assert r["code"] in {"budget_exceeded", "rate_limit_exceeded"}
        assert r["retry_after_s"] > 0 and int(r["header"]) >= 1
        assert any(limit in r["message"] for limit in ("usd_per_day", "concurrent", "requests_per_minute"))
    assert max(r["concurrent"] for r in admitted) <= POLICY.max_concurrent

    async def recorded() -> float:
        store = RedisStore(redis_server.url, prefix=key_prefix)
        snap = await store.snapshot("acme")
        await store.close()
        assert snap.concurrent == 0 and snap.windows[Window.DAY].reserved_usd == 0
        return snap.windows[Window.DAY].spend_usd

    spend = asyncio.run(recorded())
    assert spend == pytest.approx(sum(r["usd"] for r in admitted), abs=1e-9)
    assert 0.5 < spend <= 1.0 + WORST.usd


async def test_session_pin_is_seen_by_another_replica(redis_server: RedisServer, key_prefix: str) -> None:
    a = RedisStore(redis_server.url, prefix=key_prefix)
    b = RedisStore(redis_server.url, prefix=key_prefix)
    try:
        await a.step("acme", "agent-7", 30.0, 3600)
        first = await a.reserve(Hold("acme", "hq", Cost(0.01, 10), session_id="agent-7"))
        assert isinstance(first, Reservation)
        assert (await b.step("acme", "agent-7", 30.0, 3600)).pinned is None  # not until a deployment answers
        await a.settle(first, Spend(0.001, 1, 1))
        state = await b.step("acme", "agent-7", 30.0, 3600)
        assert (state.steps, state.pinned) == (3, "hq")
        second = await b.reserve(Hold("acme", "fast", Cost(0.01, 10), session_id="agent-7"))
        assert isinstance(second, Reservation)
        await b.settle(second, Spend(0.001, 1, 1))
        assert (await a.step("acme", "agent-7", 30.0, 3600)).pinned == "hq"
    finally:
        await a.close()
        await b.close()


async def test_scripts_reload_after_restart(private_redis: RedisServer) -> None:
    store = RedisStore(private_redis.url, timeout_s=0.5)
    try:
        assert isinstance(await store.reserve(Hold("acme", "hq", Cost(0.01, 10))), Reservation)
        private_redis.restart()  # same port, empty script cache, stale pooled connections
        assert isinstance(await store.reserve(Hold("acme", "hq", Cost(0.01, 10))), Reservation)
    finally:
        await store.close()


async def test_dead_redis_raises_store_error_fast(private_redis: RedisServer) -> None:
    store = RedisStore(private_redis.url, timeout_s=0.2)
    await store.ping()
    private_redis.kill()
    started = time.monotonic()
    with pytest.raises(StoreError) as info:
        await store.reserve(Hold("acme", "hq", Cost(0.01, 10)))
    assert time.monotonic() - started < 1.0
    assert info.value.__cause__ is not None
    await store.close()


async def test_hung_redis_times_out(private_redis: RedisServer) -> None:
    store = RedisStore(private_redis.url, timeout_s=0.2)
    await store.ping()
    private_redis.pause()
    try:
        started = time.monotonic()
        with pytest.raises(StoreError):
            await store.snapshot("acme")
        assert time.monotonic() - started < 1.0
    finally:
        private_redis.resume()
        await store.close()


async def _reconnected(store: FallbackStore) -> bool:
    """Whether the store reaches Redis again (it probes at most once per retry_s; until then it refuses)."""
    try:
        await store.ping()
    except StoreUnavailable:
        return False
    return True


def _fallback(server: RedisServer, mode: str) -> tuple[FallbackStore, MemoryStore]:
    local = MemoryStore()
    shared = RedisStore(server.url, timeout_s=0.2)
    return FallbackStore(shared, local, on_unavailable=mode, retry_s=0.2), local  # type: ignore[arg-type]


async def test_allow_keeps_serving_locally_and_replays_spend_after_restart(
    private_redis: RedisServer,
) -> None:
    store, _ = _fallback(private_redis, "allow")
    budgets = Budgets(store)
    limits = TenantPolicy(name="acme", budgets=(Budget(window=Window.DAY, hard_usd=1.0),))
    before = await budgets.reserve("acme", limits, "hq", Cost(0.1, 10))
    assert before.origin == "shared"
    private_redis.kill()
    started = time.monotonic()
    during = await asyncio.gather(*(budgets.reserve("acme", limits, "hq", Cost(0.1, 10)) for _ in range(5)))
    assert time.monotonic() - started < 1.0
    assert {r.origin for r in during} == {"local"} and store.degraded
    with pytest.raises(RateLimited):  # local accounting still enforces the limits
        await asyncio.gather(*(budgets.reserve("acme", limits, "hq", Cost(0.1, 10)) for _ in range(6)))
    await budgets.settle(before, _price(), Usage(1000, 0))  # shared hold, settled while Redis is down: queued
    for r in during:
        await budgets.settle(r, _price(), Usage(1000, 0))
    # the 6 settles, and the 5 reserves the outage cut off: their ids are released too, in case they ran
    assert store.pending_settles == 6 + 5
    private_redis.restart()
    await until(lambda: _reconnected(store), what="the store probed Redis again")
    after = await budgets.reserve("acme", limits, "hq", Cost(0.1, 10))
    assert after.origin == "shared" and not store.degraded
    await until(lambda: store.pending_settles == 0, what="the outage's settles replayed")
    day = (await store.snapshot("acme")).windows[Window.DAY]
    assert day.spend_usd == pytest.approx(6 * 0.001)  # the outage's spend reached the shared ledger
    await store.close()


async def test_reject_raises_store_unavailable_quickly_and_recovers(private_redis: RedisServer) -> None:
    store, _ = _fallback(private_redis, "reject")
    budgets = Budgets(store)
    held = await budgets.reserve("acme", None, "hq", Cost(0.1, 10))
    private_redis.pause()  # hung, the slow way to fail
    started = time.monotonic()
    for _ in range(20):
        with pytest.raises(StoreUnavailable) as info:
            await budgets.reserve("acme", None, "hq", Cost(0.1, 10))
        assert info.value.status == 503
    await budgets.settle(held, _price(), Usage(10, 10))  # never raises
    assert time.monotonic() - started < 1.5  # one timed-out probe, the rest refused at once
    private_redis.resume()
    private_redis.restart()
    await until(lambda: _reconnected(store), what="the store probed Redis again")
    assert (await budgets.reserve("acme", None, "hq", Cost(0.1, 10))).origin == "shared"
    await store.close()


def _price() -> Any:
    from gateway.policy.model import Price

    return Price(input_per_mtok_usd=1.0, output_per_mtok_usd=2.0)


async def test_allow_under_a_hung_redis_serves_every_request_without_waiting(
    private_redis: RedisServer,
) -> None:
    store, _ = _fallback(private_redis, "allow")
    budgets = Budgets(store)
    await budgets.observe("acme", "s", SessionPolicy())
    private_redis.pause()
    try:
        started = time.monotonic()
        seen = await asyncio.gather(*(budgets.observe("acme", "s", SessionPolicy()) for _ in range(50)))
        held = await asyncio.gather(
            *(budgets.reserve("acme", POLICY, "hq", Cost(0.01, 10)) for _ in range(20))
        )
        assert time.monotonic() - started < 1.5  # only the first probe waits for the timeout
        assert all(s.session is not None for s in seen) and {r.origin for r in held} == {"local"}
    finally:
        private_redis.resume()
    await store.close()


@pytest.mark.parametrize(
    "price",
    [(0.0, 0.0), (0.0, 1.5), (0.37, 1.13), (0.001, 0.0007)],
    ids=["free", "free-input", "fractional", "tiny"],
)
async def test_zero_and_fractional_prices_settle_and_release_on_redis(
    redis_server: RedisServer,
    key_prefix: str,
    price: tuple[float, float],
) -> None:
    from gateway.decision.admission import worst_case
    from gateway.policy.model import Deployment, Price

    dep = Deployment(url="http://127.0.0.1:1", served_model="m",
                     price=Price(input_per_mtok_usd=price[0], output_per_mtok_usd=price[1]))
    store = FallbackStore(RedisStore(redis_server.url, timeout_s=1.0, prefix=key_prefix), MemoryStore())
    budgets = Budgets(store)
    limits = TenantPolicy(name="acme", budgets=(Budget(window=Window.DAY, hard_usd=1.0, hard_tokens=10**6),))
    try:
        settled = await budgets.reserve("acme", limits, "d", worst_case(dep, 17, 64))
        await budgets.settle(settled, dep.price, Usage(11, 8))
        released = await budgets.reserve("acme", limits, "d", worst_case(dep, 17, 64))
        await budgets.release(released)
        assert {settled.origin, released.origin} == {"shared"}
        day = (await store.snapshot("acme")).windows[Window.DAY]
        assert (day.reserved_usd, day.reserved_tokens, day.tokens) == (0, 0, 19)
        assert day.spend_usd == pytest.approx(dep.price.cost_usd(11, 8, cached_tokens=0), abs=1e-9)
        assert not store.degraded and store.pending_settles == 0
        assert (await store.snapshot("acme")).concurrent == 0
    finally:
        await store.close()


async def test_a_refused_script_is_a_fault_not_an_outage(
    redis_server: RedisServer,
    key_prefix: str,
) -> None:
    from redis.asyncio import Redis

    from gateway.store.contract import Layout, StoreFault

    raw = Redis.from_url(redis_server.url)
    await raw.set(Layout(key_prefix).reservations("broken"), "not a sorted set")  # WRONGTYPE for the script
    await raw.aclose()
    store = FallbackStore(RedisStore(redis_server.url, timeout_s=1.0, prefix=key_prefix), MemoryStore())
    try:
        with pytest.raises(StoreFault):
            await store.reserve(Hold("broken", "hq", Cost(0.01, 10)))
        assert not store.degraded  # a bug must not send every tenant to local accounting
        assert (await store.reserve(Hold("acme", "hq", Cost(0.01, 10)))).origin == "shared"  # type: ignore[union-attr]
    finally:
        await store.close()


async def test_a_burst_beyond_the_pool_waits_for_connections_instead_of_falling_back(
    redis_server: RedisServer,
    key_prefix: str,
) -> None:
    # 300 requests at once: observe, reserve, settle each; redis-py's default pool stops at 100 connections
    shared = RedisStore(redis_server.url, timeout_s=1.0, prefix=key_prefix)
    store = FallbackStore(shared, MemoryStore(), retry_s=60.0)
    budgets = Budgets(store)
    limits = TenantPolicy(name="acme", budgets=(Budget(window=Window.DAY, hard_usd=100.0),))

    async def one(i: int) -> str:
        await budgets.observe("acme", f"s{i}", SessionPolicy())
        held = await budgets.reserve("acme", limits, "hq", Cost(0.01, 10))
        await budgets.settle(held, _price(), Usage(1000, 0))
        return held.origin

    try:
        origins = await asyncio.gather(*(one(i) for i in range(300)))
        assert set(origins) == {"shared"} and not store.degraded and store.pending_settles == 0
        day = (await shared.snapshot("acme")).windows[Window.DAY]
        assert (day.requests, day.reserved_usd) == (300, 0)
        assert day.spend_usd == pytest.approx(300 * 0.001)
    finally:
        await store.close()


async def test_a_pool_busy_past_its_deadline_is_503_busy_not_an_outage(
    redis_server: RedisServer,
    key_prefix: str,
) -> None:
    shared = RedisStore(redis_server.url, timeout_s=2.0, prefix=key_prefix, max_connections=1, pool_timeout_s=0.05)
    store = FallbackStore(shared, MemoryStore(), retry_s=60.0)
    # one slow command (a script that spins 0.5 s) holds the only connection
    spin = ("local t = redis.call('TIME') "
            "repeat local n = redis.call('TIME') until (n[1] - t[1]) * 1e6 + n[2] - t[2] > 5e5")
    slow = asyncio.ensure_future(shared._run(shared._redis.eval(spin, 0)))
    try:
        while not shared._slots.locked():  # the slow command holds the slot
            await asyncio.sleep(0)
        with pytest.raises(StoreUnavailable) as info:
            await store.reserve(Hold("acme", "hq", Cost(0.01, 10)))
        assert info.value.code == "store_busy" and not store.degraded
        await slow
        assert (await store.reserve(Hold("acme", "hq", Cost(0.01, 10)))).origin == "shared"  # type: ignore[union-attr]
    finally:
        await store.close()


async def _paused_reserve(
    server: RedisServer, reserve: Any, prefix: str
) -> tuple[asyncio.Task[Any], Any]:
    """Start `reserve()` while Redis holds writes (CLIENT PAUSE WRITE) and return once Redis has its script
    waiting; with the sync client for unpausing (it blocks this loop: the script runs, its reply waits unread)."""
    import redis as sync_redis

    admin = sync_redis.Redis(port=server.port)
    admin.execute_command("CLIENT", "PAUSE", "30000", "WRITE")
    task = asyncio.ensure_future(reserve())
    await until(lambda: admin.info("clients")["blocked_clients"] == 1, what="the reserve waits in Redis")
    return task, admin


def _open_holds(server: RedisServer, prefix: str) -> int:
    import redis as sync_redis

    from gateway.store.contract import Layout

    return int(sync_redis.Redis(port=server.port).zcard(Layout(prefix).reservations("acme")))


async def test_a_reserve_cancelled_after_its_script_ran_leaves_no_hold(
    private_redis: RedisServer, key_prefix: str
) -> None:
    """The client leaves while its reserve's reply is on the way: the script ran, the caller never learns
    its reservation. Its id is released in the background, so no concurrency slot or budget leaks."""
    store = FallbackStore(RedisStore(private_redis.url, timeout_s=2.0, prefix=key_prefix), MemoryStore())
    budgets = Budgets(store)
    one_at_a_time = TenantPolicy(name="acme", max_concurrent=1)
    try:
        await budgets.release(await budgets.reserve("acme", one_at_a_time, "hq", WORST))  # scripts loaded
        task, admin = await _paused_reserve(
            private_redis, lambda: budgets.reserve("acme", one_at_a_time, "hq", WORST), key_prefix)
        admin.execute_command("CLIENT", "UNPAUSE")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: _open_holds(private_redis, key_prefix) == 0, timeout_s=5, what="the hold released")
        held = await budgets.reserve("acme", one_at_a_time, "hq", WORST)  # the only slot is free
        assert held.origin == "shared" and not store.degraded
    finally:
        await store.close()


async def test_a_reserve_past_its_deadline_is_not_held_twice(private_redis: RedisServer, key_prefix: str) -> None:
    """The deadline fires while the reply of a reserve that ran is on its way: the request is held locally
    (on_unavailable allow), and the shared hold is released once Redis answers, not left to count twice."""
    now = [1000.0]
    shared = RedisStore(private_redis.url, timeout_s=0.1, prefix=key_prefix)
    store = FallbackStore(shared, MemoryStore(), retry_s=1.0, clock=lambda: now[0])
    hold = Hold("acme", "hq", WORST, ttl_s=600)
    try:
        await store.release(await store.reserve(Hold("acme", "hq", WORST)))  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        started = loop.time()
        task, admin = await _paused_reserve(private_redis, lambda: store.reserve(hold), key_prefix)
        admin.execute_command("CLIENT", "UNPAUSE")
        deadline_s = 3 * 0.1 + 0.05  # RedisStore's command deadline: 3 timeouts and a margin
        while loop.time() < started + deadline_s:  # the deadline passes while the reply is unread
            pass
        held = await task
        assert isinstance(held, Reservation) and held.origin == "local" and store.degraded
        now[0] += 2  # the next call probes Redis again; it answers, and the queue replays
        await store.snapshot("acme")
        await until(lambda: _open_holds(private_redis, key_prefix) == 0, timeout_s=5, what="the shared hold released")
        assert (await store._local.snapshot("acme")).concurrent == 1  # the local hold is the one that counts
    finally:
        await store.close()
