"""The labeller's labels of shadow pairs: a bounded stream whose entries expire.

    add_label(record_json, maxlen, ttl_s)   onto the labels stream (XADD MAXLEN); entries older than ttl_s are
                                            trimmed (XTRIM MINID) and the key expires
    labels(count) -> list[str]              the newest `count` labels, oldest first
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from gateway.store.redis_store import RedisStore


class LabelStore(Protocol):
    async def add_label(self, record_json: str, maxlen: int, ttl_s: float) -> None: ...
    async def labels(self, count: int) -> list[str]: ...
    async def close(self) -> None: ...


def labels_key(prefix: str) -> str:
    return f"{prefix}:shadow:labels"


class RedisLabelStore(RedisStore):
    """LabelStore on a Redis stream."""

    def __init__(self, url: str, *, timeout_s: float = 0.25, prefix: str = "ag") -> None:
        super().__init__(url, timeout_s=timeout_s, prefix=prefix)
        self.key = labels_key(prefix)

    async def add_label(self, record_json: str, maxlen: int, ttl_s: float) -> None:
        oldest_ms = int((time.time() - ttl_s) * 1000)
        async with self._redis.pipeline(transaction=False) as pipe:
            # Labels are few, so exact trimming is cheap; a stream id is the ms of its add: older than ttl_s goes.
            pipe.xadd(self.key, {"r": record_json}, maxlen=maxlen, approximate=False)
            pipe.xtrim(self.key, minid=oldest_ms, approximate=False)
            pipe.expire(self.key, max(1, int(ttl_s)))
            await self._run(pipe.execute())

    async def labels(self, count: int) -> list[str]:
        entries: Any = await self._run(self._redis.xrevrange(self.key, count=count))
        return [str(fields["r"]) for _, fields in reversed(entries or [])]


class MemoryLabelStore:
    """LabelStore in this process's memory, bounded and trimmed as the Redis stream is."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._labels: deque[tuple[float, str]] = deque()  # (added at, record)
        self._clock = clock

    async def add_label(self, record_json: str, maxlen: int, ttl_s: float) -> None:
        now = self._clock()
        if self._labels.maxlen != maxlen:
            self._labels = deque(self._labels, maxlen=maxlen)
        self._labels.append((now, record_json))
        while self._labels and self._labels[0][0] <= now - ttl_s:  # as XTRIM MINID: older than ttl_s goes
            self._labels.popleft()

    async def labels(self, count: int) -> list[str]:
        return [record for _, record in list(self._labels)[-count:]] if count > 0 else []

    async def close(self) -> None:
        return None
