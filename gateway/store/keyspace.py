"""The in-memory stores' keyspace: just enough of Redis' data model, with active expiry and a size bound."""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable
from typing import Any, cast

log = logging.getLogger(__name__)

# Expired keys dropped per operation: more than one operation creates, so the keyspace follows the live
# keys however the traffic moves, and no operation pays for a large backlog at once.
SWEEP_PER_TIDY = 32
MAX_KEYS = 200_000


class Keyspace:
    """Hashes, sorted sets, sets and key expiry (seconds), like Redis: an expired key is gone when read
    and, unlike a plain dict, also when nobody reads it again (`tidy`, a heap of expiries swept a few
    keys per operation). Over `max_keys`, the evictable keys that expire soonest go first."""

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        max_keys: int = MAX_KEYS,
        evictable: Callable[[str], bool] = lambda key: True,
    ) -> None:
        self.data: dict[str, Any] = {}
        self.expire_at: dict[str, float] = {}
        self.clock = clock
        self.max_keys = max_keys
        self.evictable = evictable
        self.evicted = 0
        # One entry per key with an expiry, at most as late as its expiry: a key whose expiry moves later
        # on every use (a session) keeps its entry, which is pushed again when it comes up.
        self._expiries: list[tuple[float, str]] = []
        self._queued: dict[str, float] = {}  # key -> the time of its entry in _expiries

    def get(self, key: str) -> Any:
        at = self.expire_at.get(key)
        if at is not None and at <= self.clock():
            self.delete(key)
        return self.data.get(key)

    def delete(self, key: str) -> None:
        self.data.pop(key, None)
        self.expire_at.pop(key, None)

    def hash(self, key: str) -> dict[str, Any]:
        return cast(dict[str, Any], self.get(key) or self.data.setdefault(key, {}))

    def zset(self, key: str) -> dict[str, float]:
        return cast(dict[str, float], self.get(key) or self.data.setdefault(key, {}))

    def hincr(self, key: str, field: str, by: int) -> int:
        h = self.hash(key)
        h[field] = int(h.get(field, 0)) + by
        return int(h[field])

    def expire(self, key: str, at_s: float) -> None:
        if key not in self.data:
            return
        self.expire_at[key] = at_s
        queued = self._queued.get(key)
        if queued is None or at_s < queued:
            self._queued[key] = at_s
            heapq.heappush(self._expiries, (at_s, key))

    def tidy(self) -> None:
        """Drop a few expired keys, then evict down to `max_keys`; called once per store operation."""
        now = self.clock()
        for _ in range(SWEEP_PER_TIDY):
            if not self._expiries or self._expiries[0][0] > now:
                break
            key, expires = self._next()
            if expires is not None and expires <= now:
                self.delete(key)
        if len(self.data) > self.max_keys:
            self._evict(len(self.data) - self.max_keys)

    def _next(self) -> tuple[str, float | None]:
        """Pop the earliest entry: its key and the key's expiry now (None: gone, or the entry superseded).
        A key whose expiry moved later gets its entry back at the new time."""
        at, key = heapq.heappop(self._expiries)
        if self._queued.get(key) != at:
            return key, None
        del self._queued[key]
        expires = self.expire_at.get(key)
        if expires is not None and expires > at:
            self._queued[key] = expires
            heapq.heappush(self._expiries, (expires, key))
        return key, expires

    def _evict(self, excess: int) -> None:
        """Evict the evictable keys that expire soonest, a few dozen entries per call at most."""
        kept: list[tuple[float, str]] = []
        for _ in range(SWEEP_PER_TIDY):
            if excess <= 0 or not self._expiries:
                break
            at, key = self._expiries[0]
            moved = self.expire_at.get(key, at) > at
            key, expires = self._next()
            if expires is None or moved:
                continue
            if not self.evictable(key):
                kept.append((at, key))
                continue
            self.delete(key)
            excess -= 1
            self.evicted += 1
            if self.evicted == 1 or self.evicted % 10_000 == 0:
                log.warning("in-memory store over %d keys: %d evicted so far (soonest to expire first)",
                            self.max_keys, self.evicted)
        for at, key in kept:
            self._queued[key] = at
            heapq.heappush(self._expiries, (at, key))
