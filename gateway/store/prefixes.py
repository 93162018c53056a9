"""Each agent session's prefix caches: the prompt each deployment last served it, in the shared store.

    prefixes(tenant, session_id) -> SessionPrefixes        the record (NO_PREFIXES when there is none)
    served(tenant, session_id, deployment, chain, ttl_s)   `deployment` served this prompt: its chain replaces
                                                           that deployment's, the session's home and stay
                                                           follow (context/prefix.after_serving), atomically
    served_many([Served(...), ...])                        as many served steps, in order, each atomic (one
                                                           round trip to Redis for them all)
    warmed(tenant, session_id, deployment, chain, ttl_s)   a warm-up made `deployment` prefill this prompt: its
                                                           chain replaces that deployment's, home and stay stay
                                                           (context/prefix.after_warming)

One record per session, so every replica predicts the same caches. A record idle `ttl_s` is forgotten: by then
the deployments will have evicted the prefix too.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

from gateway.context.prefix import (
    NO_PREFIXES,
    Chain,
    SessionPrefixes,
    after_serving,
    after_warming,
    decode,
    encode,
)
from gateway.store.redis_store import RedisStore

MAX_SESSIONS = 100_000  # the in-memory twin's bound: the least recently served session goes first
CHAIN_FIELD = "c:"  # + the deployment's name: its chain, encoded (context/prefix.encode)
WARMED_FIELD = "w:"  # + the deployment's name: "1" while its chain is a warm-up's, not a served step's

# KEYS[1] the session's hash; ARGV deployment, encoded chain, ttl_s. The home's stay grows by one, or another
# deployment becomes home with a stay of 1; the deployment's chain is replaced; the idle expiry starts again.
SERVED = """
local home = redis.call('HGET', KEYS[1], 'home')
if home == ARGV[1] then
  redis.call('HINCRBY', KEYS[1], 'stay', 1)
else
  redis.call('HSET', KEYS[1], 'home', ARGV[1], 'stay', 1)
end
redis.call('HSET', KEYS[1], 'c:' .. ARGV[1], ARGV[2])
redis.call('HDEL', KEYS[1], 'w:' .. ARGV[1])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
return 1
"""

# KEYS[1] the session's hash; ARGV deployment, encoded chain, ttl_s. The deployment's chain is replaced and
# marked warmed; home and stay are left as they are; the idle expiry starts again.
WARMED = """
redis.call('HSET', KEYS[1], 'c:' .. ARGV[1], ARGV[2], 'w:' .. ARGV[1], '1')
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
return 1
"""


class Served(NamedTuple):
    """One served step, as `served` takes it."""

    tenant: str
    session_id: str
    deployment: str
    chain: Chain
    ttl_s: int


class PrefixStore(Protocol):
    async def prefixes(self, tenant: str, session_id: str) -> SessionPrefixes: ...
    async def served(self, tenant: str, session_id: str, deployment: str, chain: Chain, ttl_s: int) -> None: ...
    async def served_many(self, steps: Sequence[Served]) -> None: ...
    async def warmed(self, tenant: str, session_id: str, deployment: str, chain: Chain, ttl_s: int) -> None: ...
    async def close(self) -> None: ...


def prefixes_key(prefix: str, tenant: str, session_id: str) -> str:
    # hashed like the accounting's session keys: a session id may be arbitrary header bytes
    digest = hashlib.sha256(session_id.encode()).hexdigest()[:32]
    return f"{prefix}:{{{tenant}}}:pc:{digest}"


def read_record(fields: dict[str, Any]) -> SessionPrefixes:
    """The record of a stored hash (home, stay and a chain per deployment)."""
    if not fields:
        return NO_PREFIXES
    served = {name[len(CHAIN_FIELD):]: decode(str(value)) for name, value in fields.items()
              if name.startswith(CHAIN_FIELD)}
    stay = str(fields.get("stay") or "0")
    warmed = frozenset(name[len(WARMED_FIELD):] for name in fields if name.startswith(WARMED_FIELD))
    return SessionPrefixes(served, fields.get("home") or None, int(stay) if stay.isdigit() else 0, warmed)


class RedisPrefixStore(RedisStore):
    """PrefixStore on one Redis hash per session, written by one script."""

    def __init__(self, url: str, *, timeout_s: float = 0.25, prefix: str = "ag") -> None:
        super().__init__(url, timeout_s=timeout_s, prefix=prefix)
        self.prefix = prefix
        self._served = self._redis.register_script(SERVED)
        self._warmed = self._redis.register_script(WARMED)

    async def prefixes(self, tenant: str, session_id: str) -> SessionPrefixes:
        fields: Any = await self._run(self._redis.hgetall(prefixes_key(self.prefix, tenant, session_id)))
        return read_record(fields or {})

    async def served(self, tenant: str, session_id: str, deployment: str, chain: Chain, ttl_s: int) -> None:
        await self.served_many([Served(tenant, session_id, deployment, chain, ttl_s)])

    async def served_many(self, steps: Sequence[Served]) -> None:
        async with self._redis.pipeline(transaction=False) as pipe:  # each script is atomic on its own
            for step in steps:
                key = prefixes_key(self.prefix, step.tenant, step.session_id)
                await self._served(keys=[key], args=[step.deployment, encode(step.chain), int(step.ttl_s)],
                                   client=pipe)
            await self._run(pipe.execute())

    async def warmed(self, tenant: str, session_id: str, deployment: str, chain: Chain, ttl_s: int) -> None:
        key = prefixes_key(self.prefix, tenant, session_id)
        await self._run(self._warmed(keys=[key], args=[deployment, encode(chain), int(ttl_s)]))


class MemoryPrefixStore:
    """PrefixStore in this process's memory, bounded by `max_sessions` (least recently served first out)."""

    def __init__(self, *, max_sessions: int = MAX_SESSIONS, clock: Callable[[], float] = time.time) -> None:
        self._records: OrderedDict[tuple[str, str], tuple[float, SessionPrefixes]] = OrderedDict()
        self._max, self._clock = max_sessions, clock

    async def prefixes(self, tenant: str, session_id: str) -> SessionPrefixes:
        return self._current(tenant, session_id)

    def _current(self, tenant: str, session_id: str) -> SessionPrefixes:
        found = self._records.get((tenant, session_id))
        if found is None:
            return NO_PREFIXES
        if found[0] <= self._clock():
            del self._records[(tenant, session_id)]
            return NO_PREFIXES
        return found[1]

    async def served(self, tenant: str, session_id: str, deployment: str, chain: Chain, ttl_s: int) -> None:
        await self.served_many([Served(tenant, session_id, deployment, chain, ttl_s)])

    async def served_many(self, steps: Sequence[Served]) -> None:
        for tenant, session_id, deployment, chain, ttl_s in steps:
            self._keep(tenant, session_id, after_serving(self._current(tenant, session_id), deployment, chain), ttl_s)

    async def warmed(self, tenant: str, session_id: str, deployment: str, chain: Chain, ttl_s: int) -> None:
        self._keep(tenant, session_id, after_warming(self._current(tenant, session_id), deployment, chain), ttl_s)

    def _keep(self, tenant: str, session_id: str, record: SessionPrefixes, ttl_s: int) -> None:
        self._records[(tenant, session_id)] = (self._clock() + ttl_s, record)
        self._records.move_to_end((tenant, session_id))
        while len(self._records) > self._max:
            self._records.popitem(last=False)

    async def close(self) -> None:
        return None
