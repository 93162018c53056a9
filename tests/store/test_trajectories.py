"""One behavioural table run against RedisTrajectoryStore (real redis-server) and its in-memory twin."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import pytest

from gateway.agents.spikes import bucket
from gateway.agents.trajectory import Step, ToolCall, ToolResult
from gateway.policy.agents import Recording
from gateway.store.trajectories import (
    MAX_STEP_CHARS,
    Append,
    RedisTrajectoryStore,
    TrajectoryStore,
    encode,
    fair_evictions,
)
from gateway.store.trajectory_memory import MemoryTrajectoryStore
from tests.fixtures.clock import ManualClock
from tests.fixtures.redis_server import RedisServer

T0 = float(int(time.time()) // 10 * 10)  # a spend bucket's start: T0 + 0..9 s share one
LIMITS = Recording(max_steps_per_session=3, max_sessions=3, ttl_s=600)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def store(request: pytest.FixtureRequest, clock: ManualClock, key_prefix: str) -> AsyncIterator[TrajectoryStore]:
    if request.param == "memory":
        yield MemoryTrajectoryStore(clock=clock)
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    s = RedisTrajectoryStore(server.url, timeout_s=1.0, prefix=key_prefix)
    yield s
    await s.close()


def _step(at: float, deployment: str = "hq", cost: float = 0.001, call: str = "d1") -> Step:
    return Step(at, deployment, "rule", None, 10, 5, cost, 20.0, None, 200, (ToolCall("search", call, "c"),))


def _append(session: str, at: float, tenant: str = "acme", **kw: object) -> Append:
    fields: dict[str, object] = {"active": {}, **kw}
    return Append(tenant, session, _step(at), 1.0, **fields)  # type: ignore[arg-type]


async def test_steps_are_numbered_summed_and_read_back(store: TrajectoryStore) -> None:
    await store.append([_append("s1", T0), _append("s1", T0 + 1)], {}, LIMITS)
    await store.append([_append("s1", T0 + 2, active={"loop:x": (T0 + 60, "x 3 times")}, raised=("loop:x",))], {},
                       LIMITS)
    record = (await store.read([("acme", "s1"), ("acme", "none")], 2))[("acme", "s1")]
    assert (record.steps_total, record.started_at, record.last_at) == (3, T0, T0 + 2)
    assert [s.step for s in record.steps] == [2, 3] and record.steps[0].tool_calls[0].name == "search"
    assert record.active == {"loop:x": (T0 + 60, "x 3 times")}
    assert record.spend.since == T0 and sum(record.spend.buckets.values()) == pytest.approx(0.003)
    found = await store.session("s1", "acme")
    assert found is not None
    summary = found[0]
    assert (summary.tokens_in, summary.tokens_out, summary.deployments) == (30, 15, {"hq": 3})
    assert summary.flags == ["loop:x"] and summary.cost_usd == pytest.approx(0.003)
    assert await store.active(("acme", "s1")) == {"loop:x": (T0 + 60, "x 3 times")}
    assert (await store.read([("acme", "none")], 2))[("acme", "none")].steps_total == 0
    await store.append([_append("s1", T0 + 30, cleared=("loop:x",), forget=(bucket(T0),))], {}, LIMITS)
    record = (await store.read([("acme", "s1")], 5))[("acme", "s1")]
    found = await store.session("s1")
    assert record.active == {} and found is not None and found[0].flags == ["loop:x"]
    assert bucket(T0) not in record.spend.buckets


async def test_a_session_keeps_its_last_steps_and_counts_them_all(store: TrajectoryStore) -> None:
    await store.append([_append("long", T0 + i) for i in range(5)], {}, LIMITS)
    found = await store.session("long")
    assert found is not None
    summary, steps = found
    assert summary.steps == 5 and [s.step for s in steps] == [3, 4, 5]


async def test_the_least_recently_active_session_goes_first(store: TrajectoryStore) -> None:
    await store.append([_append("a", T0), _append("b", T0 + 1), _append("c", T0 + 2)], {}, LIMITS)
    await store.append([_append("a", T0 + 3), _append("d", T0 + 4, tenant="globex")], {}, LIMITS)
    assert [s.session_id for s in await store.sessions(None, 10)] == ["d", "a", "c"]
    assert [s.session_id for s in await store.sessions("acme", 10)] == ["a", "c"]
    assert await store.session("b") is None
    found = await store.session("d")
    assert found is not None and found[0].tenant == "globex"


async def test_the_same_session_id_of_two_tenants_is_two_sessions(store: TrajectoryStore) -> None:
    await store.append([_append("s", T0, tenant="acme"), _append("s", T0 + 1, tenant="globex")], {}, LIMITS)
    acme, globex = await store.session("s", "acme"), await store.session("s")
    assert acme is not None and globex is not None
    assert (acme[0].tenant, acme[0].steps, globex[0].tenant) == ("acme", 1, "globex")


async def test_idle_sessions_past_the_ttl_leave_the_list(store: TrajectoryStore, clock: ManualClock) -> None:
    await store.append([_append("old", T0)], {}, LIMITS)
    clock.now = T0 + 700
    await store.append([_append("new", T0 + 700)], {}, LIMITS)
    assert [s.session_id for s in await store.sessions(None, 10)] == ["new"]


async def test_tenant_spend_is_bucketed_and_old_buckets_forgotten(store: TrajectoryStore) -> None:
    await store.append([_append("s", T0), _append("s", T0 + 30)], {}, LIMITS)
    series = (await store.tenant_spend(["acme", "nobody"]))["acme"]
    assert series.since == T0 and series.buckets == {bucket(T0): 0.001, bucket(T0 + 30): 0.001}
    await store.append([_append("s", T0 + 31)], {"acme": [bucket(T0)]}, LIMITS)
    assert (await store.tenant_spend(["acme"]))["acme"].buckets == {bucket(T0 + 30): pytest.approx(0.002)}


def test_a_stored_step_encodes_to_a_bounded_size_keeping_its_digests_first() -> None:
    calls = tuple(ToolCall("é" * 128, "d" * 16, "i" * 128, "a" * 4096) for _ in range(64))
    results = tuple(ToolResult("r" * 128, False, 10**6, "e" * 16, "c" * 4096) for _ in range(64))
    step = Step(T0, "hq", "rule", None, 1, 1, 0.0, 1.0, None, 200, calls, results, prompt="p" * 4096)
    text = encode(step)
    assert len(text) <= MAX_STEP_CHARS
    back = Step.from_dict(json.loads(text))
    assert back.prompt is None and back.tool_calls and back.tool_results
    assert all(c.arguments is None and c.args_digest == "d" * 16 for c in back.tool_calls)
    assert all(r.content is None and not r.ok for r in back.tool_results)
    small = Step(T0, "hq", "rule", None, 1, 1, 0.0, 1.0, None, 200, calls[:2], results[:2], prompt="p")
    assert Step.from_dict(json.loads(encode(small))).to_dict() == {**small.to_dict(), "step": 0}


async def test_a_tenant_that_floods_the_record_evicts_its_own_sessions_not_the_others(store: TrajectoryStore) -> None:
    limits = Recording(max_steps_per_session=3, max_sessions=6, ttl_s=600)
    stopped = {"loop:repeated_tool_call": (T0 + 600, "search 3 times")}
    await store.append([_append("run-1", T0, active=stopped), _append("run-2", T0 + 1),
                        _append("b-1", T0 + 2, tenant="globex")], {}, limits)
    for i in range(3):  # random session ids, many batches of them, all more recent than the others' sessions
        await store.append([_append(f"junk-{i}-{j}", T0 + 10 + i * 10 + j, tenant="flood") for j in range(10)],
                           {}, limits)
    assert await store.active(("acme", "run-1")) == stopped
    assert {(s.tenant, s.session_id) for s in await store.sessions(None, 10)} >= {
        ("acme", "run-1"), ("acme", "run-2"), ("globex", "b-1")}
    flood = await store.sessions("flood", 10)
    assert [s.session_id for s in flood] == ["junk-2-9", "junk-2-8", "junk-2-7"]  # its newest, up to a fair share
    # once the flood stops being the largest, the largest pays: here acme, its least recent session first
    await store.append([_append(f"a-{j}", T0 + 100 + j) for j in range(2)], {},
                       Recording(max_steps_per_session=3, max_sessions=7, ttl_s=600))
    assert {s.session_id for s in await store.sessions("acme", 10)} == {"run-2", "a-0", "a-1"}


def test_fair_evictions_take_from_the_largest_until_level() -> None:
    assert fair_evictions({"a": 10, "b": 3, "c": 1}, 8) == {"a": 8}
    assert fair_evictions({"a": 10, "b": 3, "c": 1}, 9) == {"a": 8, "b": 1}
    assert sum(fair_evictions({"a": 2, "b": 2}, 10).values()) == 4 and fair_evictions({}, 3) == {}


async def test_sessions_are_ranked_by_sort_and_limited(store: TrajectoryStore) -> None:
    limits = Recording(max_steps_per_session=3, max_sessions=100, ttl_s=600)
    await store.append([Append("acme", f"s{i}", _step(T0 + i, cost=[3, 1, 4, 1, 5][i] / 1000), float(i), {})
                        for i in range(5)], {}, limits)
    assert [s.session_id for s in await store.sessions(None, 2, "cost")] == ["s4", "s2"]
    assert [s.session_id for s in await store.sessions(None, 2, "rate")] == ["s4", "s3"]
    assert [s.session_id for s in await store.sessions("acme", 3)] == ["s4", "s3", "s2"]
    assert await store.sessions("nobody", 3, "steps") == []


# --- outcomes ---

async def test_an_outcome_is_kept_with_its_session_and_replacements_are_audited(store: TrajectoryStore) -> None:
    from gateway.agents.outcomes import HISTORY_KEPT, Outcome

    member = "hq-v2\t0\t1\tcandidate"
    await store.append([_append("s1", T0, route="auto", rollout=member), _append("s1", T0 + 1)], {}, LIMITS)
    first = await store.set_outcome(("acme", "s1"), Outcome(True, 0.9, "tests pass", {"task": "t1"}, at=T0 + 2))
    assert first is not None
    summary, replaced = first
    assert replaced is None and summary.outcome is not None and summary.replaced == []
    assert (summary.outcome.cost_usd, summary.outcome.steps) == (pytest.approx(0.002), 2)  # as of the report
    assert summary.outcome.rollout == member and summary.route == "auto" and summary.membership is not None
    for i in range(HISTORY_KEPT + 1):
        written = await store.set_outcome(("acme", "s1"), Outcome(i % 2 == 0, reason=f"r{i}", at=T0 + 3 + i))
        assert written is not None and written[1] is not None
    found = await store.session("s1", "acme")
    assert found is not None
    kept = found[0]
    assert kept.outcome is not None and kept.outcome.reason == f"r{HISTORY_KEPT}"
    assert [o.reason for o in kept.replaced] == [f"r{i}" for i in range(1, HISTORY_KEPT)]  # bounded, oldest first
    shown = kept.to_dict()
    assert shown["outcome"]["reason"] == f"r{HISTORY_KEPT}" and shown["arm"] == "candidate"
    listed = await store.sessions("acme", 10)
    assert listed[0].outcome is not None and listed[0].outcome.reason == f"r{HISTORY_KEPT}"


async def test_an_unknown_or_other_tenants_session_gets_no_outcome(store: TrajectoryStore) -> None:
    from gateway.agents.outcomes import Outcome

    await store.append([_append("s1", T0)], {}, LIMITS)
    assert await store.set_outcome(("other", "s1"), Outcome(True)) is None
    assert await store.set_outcome(("acme", "nope"), Outcome(True)) is None
    assert await store.sessions("other", 10) == []  # nothing was created for the other tenant
    found = await store.session("s1", "acme")
    assert found is not None and found[0].outcome is None


async def test_a_session_past_its_ttl_takes_no_outcome(clock: ManualClock) -> None:
    from gateway.agents.outcomes import Outcome

    store = MemoryTrajectoryStore(clock=clock)
    await store.append([_append("s1", T0)], {}, LIMITS)
    clock.now = T0 + LIMITS.ttl_s + 1
    assert await store.set_outcome(("acme", "s1"), Outcome(True)) is None


@pytest.mark.redis
async def test_redis_writes_no_outcome_once_the_session_expired(redis_server: RedisServer, key_prefix: str) -> None:
    from gateway.agents.outcomes import Outcome

    store = RedisTrajectoryStore(redis_server.url, timeout_s=1.0, prefix=key_prefix)
    await store.append([_append("s1", T0)], {}, LIMITS)
    ref = ("acme", "s1")
    await store._redis.delete(store.keys.summary(ref))  # as its TTL would: the script's EXISTS check sees it gone
    assert await store.set_outcome(ref, Outcome(True)) is None
    assert await store._redis.exists(store.keys.summary(ref)) == 0  # not re-created by the write
    await store.close()
