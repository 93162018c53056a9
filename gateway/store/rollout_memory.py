"""The in-memory twin of RedisRolloutStore: one process's rollout states, counters and arms, no Redis.

The leader lock is trivially this process's. Counters and arms expire after their TTLs as in Redis (and over
the keyspace's bound, the arms that expire soonest go first). tests/store/test_rollouts.py runs one contract
against both.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

from gateway.rollout.state import RolloutState
from gateway.store.keyspace import MAX_KEYS, Keyspace

CHANGES_IDLE_S = 1.0  # as Redis' pub/sub poll: a None this often without a change


class MemoryRolloutStore:
    """RolloutStore in this process's memory; the embedded default with no Redis."""

    def __init__(self, *, clock: Callable[[], float] = time.time, max_keys: int = MAX_KEYS) -> None:
        self._states: dict[str, RolloutState] = {}  # frozen values: nothing outside can change a stored one
        self._ks = Keyspace(clock, max_keys=max_keys, evictable=lambda key: ":ro:arm:" in key)
        self._clock = clock
        self._listeners: list[asyncio.Queue[str]] = []

    async def read_state(self, route: str) -> RolloutState | None:
        return self._states.get(route)

    async def write_state(self, route: str, expected_gen: int, state: RolloutState, fence: int) -> bool:
        current = self._states.get(route)
        if (-1 if current is None else current.generation) != expected_gen:
            return False
        self._states[route] = state
        for queue in self._listeners:
            queue.put_nowait(route)
        return True

    async def lead(self, owner: str, ttl_s: float) -> int | None:
        return 1

    async def count(self, key: str, fields: Mapping[str, int], ttl_s: int) -> dict[str, int]:
        self._ks.tidy()
        h = self._ks.hash(key)
        for name, by in fields.items():
            h[name] = h.get(name, 0) + by
        self._ks.expire(key, self._clock() + ttl_s)
        return {name: h[name] for name in fields}

    async def counts(self, key: str) -> dict[str, int]:
        return dict(self._ks.get(key) or {})

    async def record_arm(self, key: str, value: str, ttl_s: int) -> str:
        self._ks.tidy()
        recorded = self._ks.get(key)
        if recorded is not None:
            return str(recorded)
        self._ks.data[key] = value
        self._ks.expire(key, self._clock() + ttl_s)
        return value

    async def touch_arms(self, keys: Sequence[str], ttl_s: int) -> None:
        at = self._clock() + ttl_s
        for key in keys:
            if self._ks.get(key) is not None:  # an arm that lapsed stays lapsed, as EXPIRE leaves it in Redis
                self._ks.expire(key, at)

    async def changes(self) -> AsyncIterator[str | None]:
        queue: asyncio.Queue[str] = asyncio.Queue()
        self._listeners.append(queue)
        try:
            while True:
                try:
                    yield await asyncio.wait_for(queue.get(), CHANGES_IDLE_S)
                except TimeoutError:
                    yield None
        finally:
            self._listeners.remove(queue)

    async def close(self) -> None:
        return None
