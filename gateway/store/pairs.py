"""Shadow pairs (a primary's answer beside its shadow's, compared), newest kept, per target and for all targets.

    add_pair(target, record_json, maxlen)      onto the target's stream and the stream of every target
                                               (XADD MAXLEN ~: stream ids only order one stream's entries)
    pairs(target | None, count) -> list[str]   the newest `count` records (None: every target's), oldest first
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Any, Protocol

from gateway.store.redis_store import RedisStore

ALL_TARGETS = "*"  # the stream of every target's pairs


class ShadowPairStore(Protocol):
    async def add_pair(self, target: str, record_json: str, maxlen: int) -> None: ...
    async def pairs(self, target: str | None, count: int) -> list[str]: ...
    async def close(self) -> None: ...


def pairs_key(prefix: str, target: str) -> str:
    return f"{prefix}:shadow:pairs:{target}"


class RedisShadowPairStore(RedisStore):
    """ShadowPairStore on Redis streams."""

    def __init__(self, url: str, *, timeout_s: float = 0.25, prefix: str = "ag") -> None:
        super().__init__(url, timeout_s=timeout_s, prefix=prefix)
        self.prefix = prefix

    async def add_pair(self, target: str, record_json: str, maxlen: int) -> None:
        async with self._redis.pipeline(transaction=False) as pipe:
            for stream in (pairs_key(self.prefix, target), pairs_key(self.prefix, ALL_TARGETS)):
                pipe.xadd(stream, {"r": record_json}, maxlen=maxlen, approximate=True)
            await self._run(pipe.execute())

    async def pairs(self, target: str | None, count: int) -> list[str]:
        stream = pairs_key(self.prefix, target or ALL_TARGETS)
        entries: Any = await self._run(self._redis.xrevrange(stream, count=count))
        return [str(fields["r"]) for _, fields in reversed(entries or [])]


class MemoryShadowPairStore:
    """ShadowPairStore in this process's memory: each target's newest `maxlen` pairs."""

    def __init__(self) -> None:
        self._pairs: dict[str, deque[tuple[int, str]]] = {}
        self._seq = itertools.count()  # orders the pairs of every target, as the all-targets stream does

    async def add_pair(self, target: str, record_json: str, maxlen: int) -> None:
        self._pairs.setdefault(target, deque(maxlen=maxlen)).append((next(self._seq), record_json))

    async def pairs(self, target: str | None, count: int) -> list[str]:
        targets = [target] if target else list(self._pairs)
        found = sorted(item for name in targets for item in self._pairs.get(name, ()))
        return [record for _, record in found[-count:]]

    async def close(self) -> None:
        return None
