"""The fleet's complexity-score windows, one per rule-routed model, which keep the live share thresholds in step.

    share_window(route, scores, window) -> list[float]   append this replica's new scores to the route's
                                                         fleet-wide window (the last `window` kept); returns it
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from gateway.store.redis_store import RedisStore

SHARE_WINDOW_TTL_S = 24 * 3600  # a route with no traffic for a day starts again from its calibration


class ShareWindowStore(Protocol):
    async def share_window(self, route: str, scores: list[float], window: int) -> list[float]: ...
    async def close(self) -> None: ...


def scores_key(prefix: str, route: str) -> str:
    return f"{prefix}:share:scores:{route}"


class RedisShareWindowStore(RedisStore):
    """ShareWindowStore on Redis lists, one per route, appended and read in one transaction."""

    def __init__(self, url: str, *, timeout_s: float = 0.25, prefix: str = "ag") -> None:
        super().__init__(url, timeout_s=timeout_s, prefix=prefix)
        self.prefix = prefix

    async def share_window(self, route: str, scores: list[float], window: int) -> list[float]:
        key = scores_key(self.prefix, route)
        async with self._redis.pipeline(transaction=True) as pipe:
            if scores:
                pipe.rpush(key, *(f"{s:.6g}" for s in scores))
                pipe.ltrim(key, -window, -1)
                pipe.expire(key, SHARE_WINDOW_TTL_S)
            pipe.lrange(key, -window, -1)
            replies = await self._run(pipe.execute())
        return [float(s) for s in replies[-1]]


class MemoryShareWindowStore:
    """ShareWindowStore in this process's memory (one process: its own window is the fleet's)."""

    def __init__(self) -> None:
        self._scores: dict[str, deque[float]] = {}

    async def share_window(self, route: str, scores: list[float], window: int) -> list[float]:
        kept = self._scores.get(route)
        if kept is None or kept.maxlen != window:
            kept = self._scores[route] = deque(kept or (), maxlen=window)
        kept.extend(scores)
        return list(kept)

    async def close(self) -> None:
        return None
