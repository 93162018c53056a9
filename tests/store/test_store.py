"""One behavioural table run against RedisStore (real redis-server) and its in-memory twin."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest

from gateway.decision.admission import Cost
from gateway.policy.tenancy import Window
from gateway.store.contract import Hold, Limits, Refusal, Reservation, Spend, Store
from gateway.store.memory import MemoryStore
from gateway.store.redis_store import RedisStore
from tests.fixtures.clock import ManualClock
from tests.fixtures.redis_server import RedisServer

# A fixed instant in the future (so Redis EXPIREAT never lands in the past): 5 s into tomorrow, UTC.
T0 = (int(time.time()) // 86400 + 1) * 86400 + 5.0


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def store(
    request: pytest.FixtureRequest,
    clock: ManualClock,
    key_prefix: str,
) -> AsyncIterator[Store]:
    if request.param == "memory":
        yield MemoryStore(prefix=key_prefix, clock=clock)
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    s = RedisStore(server.url, timeout_s=1.0, prefix=key_prefix, clock=clock)
    yield s
    await s.close()


def hold(usd: float = 0.1, tokens: int = 100, limits: Limits | None = None, **kw: object) -> Hold:
    return Hold("acme", "hq", Cost(usd, tokens), limits or Limits(), **kw)  # type: ignore[arg-type]


async def held(store: Store, h: Hold) -> Reservation:
    r = await store.reserve(h)
    assert isinstance(r, Reservation), r
    return r


async def test_reserve_holds_worst_case_in_every_window(store: Store) -> None:
    await held(store, hold(0.25, 300))
    snap = await store.snapshot("acme")
    assert snap.concurrent == 1
    for window in Window:
        w = snap.windows[window]
        assert (w.reserved_usd, w.reserved_tokens, w.requests, w.spend_usd) == (0.25, 300, 1, 0.0)


async def test_hard_usd_refusal_names_limit_and_retry_after_and_has_no_side_effects(
    store: Store, clock: ManualClock
) -> None:
    limits = Limits(usd={Window.DAY: 1.0})
    await held(store, hold(0.6, limits=limits))
    before = await store.snapshot("acme")
    refused = await store.reserve(hold(0.5, limits=limits))
    assert isinstance(refused, Refusal)
    assert refused.limit == "usd_per_day"
    assert refused.retry_after_s == pytest.approx(86400 - 5)
    assert await store.snapshot("acme") == before


async def test_all_or_nothing_across_windows(store: Store) -> None:
    limits = Limits(usd={Window.MINUTE: 10.0, Window.HOUR: 0.5})
    refused = await store.reserve(hold(0.6, limits=limits))
    assert refused == Refusal("usd_per_hour", pytest.approx(3600 - 5))
    snap = await store.snapshot("acme")
    assert snap.windows[Window.MINUTE].requests == 0
    assert snap.windows[Window.MINUTE].reserved_usd == 0
    assert snap.concurrent == 0


async def test_settle_replaces_hold_by_actual_spend_exactly(store: Store) -> None:
    r = await held(store, hold(0.5, 1000))
    assert await store.settle(r, Spend(0.123456789, 40, 60)) is True
    snap = await store.snapshot("acme")
    assert snap.concurrent == 0
    for window in Window:
        w = snap.windows[window]
        assert (w.spend_usd, w.reserved_usd, w.tokens, w.reserved_tokens, w.requests) == (
            0.123456789, 0.0, 100, 0, 1,
        )  # fmt: skip


async def test_many_settles_sum_exactly(store: Store) -> None:
    for _ in range(50):
        r = await held(store, hold(0.01, 10))
        await store.settle(r, Spend(0.001, 1, 2))
    day = (await store.snapshot("acme")).windows[Window.DAY]
    assert day.spend_usd == pytest.approx(0.05, abs=1e-12)
    assert (day.tokens, day.requests, day.reserved_usd) == (150, 50, 0.0)


async def test_release_frees_hold_without_spend_and_is_idempotent(store: Store) -> None:
    r = await held(store, hold(0.5, 1000))
    assert await store.release(r) is True
    assert await store.release(r) is False
    snap = await store.snapshot("acme")
    day = snap.windows[Window.DAY]
    assert (snap.concurrent, day.spend_usd, day.reserved_usd, day.reserved_tokens) == (0, 0.0, 0.0, 0)
    assert day.requests == 1  # an attempt still counts against the request rate


async def test_requests_per_minute(store: Store, clock: ManualClock) -> None:
    limits = Limits(requests_per_minute=3)
    for _ in range(3):
        await store.release(await held(store, hold(limits=limits)))
    refused = await store.reserve(hold(limits=limits))
    assert refused == Refusal("requests_per_minute", pytest.approx(55))
    clock.now += 60
    await held(store, hold(limits=limits))


async def test_tokens_per_minute(store: Store) -> None:
    limits = Limits(tokens={Window.MINUTE: 1000})
    await held(store, hold(tokens=600, limits=limits))
    refused = await store.reserve(hold(tokens=600, limits=limits))
    assert isinstance(refused, Refusal) and refused.limit == "tokens_per_minute"


async def test_max_concurrent(store: Store) -> None:
    limits = Limits(max_concurrent=2)
    first = await held(store, hold(limits=limits))
    await held(store, hold(limits=limits))
    assert await store.reserve(hold(limits=limits)) == Refusal("concurrent", 1.0)
    await store.settle(first, Spend(0.01, 1, 1))
    await held(store, hold(limits=limits))


async def test_reservation_expires_and_late_settle_still_records_spend(store: Store, clock: ManualClock) -> None:
    limits = Limits(usd={Window.DAY: 1.0}, max_concurrent=1)
    r = await held(store, hold(0.9, limits=limits, ttl_s=10))
    clock.now += 11  # the replica that held it crashed
    snap = await store.snapshot("acme")
    assert (snap.concurrent, snap.windows[Window.DAY].reserved_usd) == (0, 0.0)
    second = await held(store, hold(0.9, limits=limits, ttl_s=10))
    assert await store.settle(r, Spend(0.05, 5, 5)) is False  # expired, but it did run: record it
    assert await store.release(second) is True
    day = (await store.snapshot("acme")).windows[Window.DAY]
    assert (day.spend_usd, day.reserved_usd, day.tokens) == (0.05, 0.0, 10)


async def test_settle_lands_in_the_buckets_it_was_reserved_in(store: Store, clock: ManualClock) -> None:
    r = await held(store, hold(0.5, 100))
    clock.now += 60  # a new minute started while the request ran
    await store.settle(r, Spend(0.2, 10, 10))
    snap = await store.snapshot("acme")
    assert snap.windows[Window.MINUTE].spend_usd == 0.0
    assert snap.windows[Window.HOUR].spend_usd == 0.2
    assert snap.windows[Window.HOUR].reserved_usd == 0.0


async def test_new_window_starts_empty(store: Store, clock: ManualClock) -> None:
    r = await held(store, hold(0.5, 100))
    await store.settle(r, Spend(0.2, 10, 10))
    clock.now += 3600
    snap = await store.snapshot("acme")
    assert snap.windows[Window.HOUR].spend_usd == 0.0
    assert snap.windows[Window.DAY].spend_usd == 0.2


async def test_session_steps_rate_pin_and_cost(store: Store, clock: ManualClock) -> None:
    for _ in range(5):
        state = await store.step("acme", "sess-1", 30.0, 3600)
        clock.now += 1
    assert (state.steps, state.steps_per_min, state.pinned, state.cost_usd) == (5, 10.0, None, 0.0)
    r = await held(store, hold(0.5, 100, session_id="sess-1"))
    await store.settle(r, Spend(0.3, 1, 1))
    await held(store, Hold("acme", "fast", Cost(0.1, 10), Limits(), session_id="sess-1"))
    state = await store.step("acme", "sess-1", 30.0, 3600)
    assert (state.steps, state.pinned, state.cost_usd) == (6, "hq", 0.3)
    clock.now += 31
    assert (await store.step("acme", "sess-1", 30.0, 3600)).steps_per_min == 2.0


async def test_sessions_are_per_tenant(store: Store) -> None:
    await store.step("acme", "s", 30.0, 3600)
    await held(store, hold(session_id="s"))
    other = await store.step("globex", "s", 30.0, 3600)
    assert (other.steps, other.pinned) == (1, None)


async def test_usage_rows_per_deployment(store: Store) -> None:
    await store.settle(await held(store, hold(0.5, 100)), Spend(0.2, 10, 20))
    r = await held(store, Hold("acme", "fast", Cost(0.1, 10), Limits()))
    await store.settle(r, Spend(0.01, 3, 4))
    await held(store, hold(0.5, 100))  # still open
    day = {row.deployment: row for row in await store.usage("acme") if row.window is Window.DAY}
    assert set(day) == {"*", "hq", "fast"}
    assert (day["*"].spend_usd, day["*"].tokens_in, day["*"].tokens_out, day["*"].requests) == (
        0.21,
        13,
        24,
        3,
    )
    assert day["*"].reserved_usd == 0.5
    assert (day["hq"].spend_usd, day["hq"].tokens_in, day["hq"].tokens_out, day["hq"].requests) == (
        0.2,
        10,
        20,
        1,
    )
    assert [r.tenant for r in await store.usage()] == ["acme"] * len(await store.usage("acme"))


async def test_keys_put_find_list_delete(store: Store) -> None:
    from gateway.store.contract import KeyRecord

    rec = KeyRecord("1a2b3c4d", "acme", "agk-1a2b3c4d", "d" * 64, 1700000000.5, "ci")
    await store.put_key(rec)
    assert await store.find_key("d" * 64) == rec
    assert await store.list_keys() == [rec]
    assert await store.delete_key("1a2b3c4d") == rec
    assert await store.find_key("d" * 64) is None
    assert await store.delete_key("1a2b3c4d") is None


async def test_observe_reads_windows_and_steps_the_session_at_once(store: Store) -> None:
    r = await held(store, hold(0.5, 100, session_id="s1"))
    seen = await store.observe("acme", "s1", 30.0, 3600)
    assert seen.snapshot.concurrent == 1 and seen.snapshot.windows[Window.DAY].reserved_usd == 0.5
    assert seen.session is not None and (seen.session.steps, seen.session.pinned) == (1, None)
    await store.settle(r, Spend(0.25, 1, 1))  # the first answered step pins the session
    again = await store.observe("acme", "s1", 30.0, 3600)
    assert again.session is not None
    assert (again.session.steps, again.session.cost_usd, again.session.pinned) == (2, 0.25, "hq")
    assert (await store.observe("acme", None)).session is None


@pytest.mark.redis
async def test_redis_and_memory_agree_on_a_random_history(redis_server: RedisServer, key_prefix: str) -> None:
    """The twin is only useful if it is a twin: replay one random history on both and compare every read."""
    import random

    rng = random.Random(5)
    clock = ManualClock(T0)
    stores: list[Store] = [
        MemoryStore(prefix=key_prefix, clock=clock),
        RedisStore(redis_server.url, prefix=key_prefix, clock=clock),
    ]
    limits = Limits(
        usd={Window.MINUTE: 0.5, Window.DAY: 2.0},
        tokens={Window.HOUR: 5000},
        requests_per_minute=20,
        max_concurrent=4,
    )
    open_: list[list[Reservation]] = []
    seen: set[str] = set()
    try:
        for _ in range(300):
            action = rng.choice(["reserve", "reserve", "settle", "release", "tick", "step"])
            usd, tokens = round(rng.uniform(0.01, 0.3), 4), rng.randint(10, 900)
            sid, ttl = rng.choice([None, "a", "b"]), rng.choice([5.0, 60.0])
            dep = rng.choice(["hq", "fast"])
            if action == "tick":
                clock.now += rng.choice([0.5, 3, 20, 61])
                continue
            if action == "step":
                states = [await s.step("acme", "a", 30.0, 3600) for s in stores]
                assert states[0] == states[1]
                continue
            if action == "reserve":
                results = [
                    await s.reserve(Hold("acme", dep, Cost(usd, tokens), limits, sid, ttl)) for s in stores
                ]
                assert type(results[0]) is type(results[1])
                if isinstance(results[0], Refusal):
                    assert results[0] == results[1]
                    seen.add(results[0].limit)
                else:
                    open_.append(results)  # type: ignore[arg-type]
            elif open_:
                pair = open_.pop(rng.randrange(len(open_)))
                spend = Spend(round(usd / 2, 4), tokens // 3, tokens // 3)
                got = [
                    await (s.settle(r, spend) if action == "settle" else s.release(r))
                    for s, r in zip(stores, pair, strict=True)
                ]
                assert got[0] == got[1]
            snaps = [await s.snapshot("acme") for s in stores]
            assert snaps[0] == snaps[1]
        usage = [await s.usage("acme") for s in stores]
        assert usage[0] == usage[1]
        assert len(seen) >= 3, seen  # the history reached several limits
    finally:
        await stores[1].close()


async def test_the_memory_store_forgets_idle_sessions_and_ended_minutes_nobody_reads_again() -> None:
    clock = ManualClock(T0)
    store = MemoryStore(clock=clock)
    for i in range(3000):  # 3,000 one-step sessions and a minute bucket per minute, never read again
        clock.now = T0 + i * 0.1
        await store.observe("acme", f"agent-{i}", 30.0, 3600)
        await store.settle(await held(store, hold(0.001, 10)), Spend(0.001, 5, 5))
    assert len(store._ks.data) > 6000
    clock.now += 3600 + 200  # every session idle past its TTL, every minute bucket past its retention
    for _ in range(250):  # ordinary traffic of one live session sweeps the rest away as it goes
        state = await store.step("acme", "live", 30.0, 3600)
    assert state.steps == 250
    assert len(store._ks.data) < 20, sorted(store._ks.data)[:20]
    assert (await store.snapshot("acme")).windows[Window.DAY].spend_usd == pytest.approx(3.0)


async def test_the_memory_store_has_a_size_bound_and_evicts_idle_sessions_first() -> None:
    clock = ManualClock(T0)
    store = MemoryStore(clock=clock, max_keys=1000)
    for i in range(5000):
        clock.now = T0 + i * 0.01
        await store.observe("acme", f"agent-{i}", 30.0, 3600)
        if i % 100 == 0:
            await store.settle(await held(store, hold(0.001, 10)), Spend(0.001, 5, 5))
    assert len(store._ks.data) <= 1000 + 2
    assert (await store.step("acme", "agent-4999", 30.0, 3600)).steps == 2  # the newest sessions stay
    assert (await store.step("acme", "agent-0", 30.0, 3600)).steps == 1  # the oldest idle one went
    assert (await store.snapshot("acme")).windows[Window.DAY].spend_usd == pytest.approx(0.05)  # never evicted
