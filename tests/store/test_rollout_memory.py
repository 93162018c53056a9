"""The in-memory rollout store's own bounds: arms and counters expire as in Redis, and arms are evicted first."""

from __future__ import annotations

from gateway.store.rollout_memory import MemoryRolloutStore


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
