"""Rollout state in Redis: CAS'd rollout states, the leader lock, cohort counters and sessions' arms.

The shadow pairs (store/pairs.py), the labels (store/labels.py) and the share windows (store/shares.py) have
stores of their own. `RedisRolloutStore` reuses RedisStore's client construction and its exception
translation (`_run` turns every redis error into `StoreError`); `rollout_memory.MemoryRolloutStore` is its twin.

    read_state(route) -> RolloutState | None              the rollout's state, decoded
    write_state(route, expected_gen, state, fence) -> bool
                                                          compare-and-set on the generation (-1: absent);
                                                          fence > 0 also requires the leader lock's token;
                                                          publishes the route on CHANNEL when written
    lead(owner, ttl_s) -> int | None                      take or renew the leader lock: the fencing token
    count(key, fields, ttl_s) -> dict[str, int]           HINCRBY each field; the new totals
    counts(key) -> dict[str, int]                         HGETALL
    record_arm(key, value, ttl_s) -> str                  SET NX: the value that is now recorded
    touch_arms(keys, ttl_s)                               EXPIRE each: a session's steps keep its arm alive
    changes() -> AsyncIterator[str | None]                routes published on CHANNEL; None every ~1 s
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Protocol

from gateway.rollout.state import RolloutState
from gateway.store.contract import StoreError
from gateway.store.redis_store import RedisStore

CHANNEL = "rollouts"

# write_state: KEYS[1]=state, KEYS[2]=leader lock; ARGV: expected generation (-1: absent), new state JSON,
#   fencing token (0: a manual operation, no lock needed), channel, route -> 1 written, 0 refused
WRITE_STATE = """
local cur = redis.call('GET', KEYS[1])
local gen = -1
if cur then gen = tonumber(cjson.decode(cur)['generation']) end
if gen ~= tonumber(ARGV[1]) then return 0 end
if ARGV[3] ~= '0' then
  local lock = redis.call('GET', KEYS[2])
  if not lock or string.match(lock, ':(%d+)$') ~= ARGV[3] then return 0 end
end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('PUBLISH', ARGV[4], ARGV[5])
return 1
"""

# lead: KEYS[1]=leader lock ("owner:token"), KEYS[2]=fence counter; ARGV: owner, ttl_ms
#   -> the holder's fencing token if `owner` holds (or just took) the lock, else nil
LEAD = """
local cur = redis.call('GET', KEYS[1])
if cur then
  local owner, token = string.match(cur, '^(.*):(%d+)$')
  if owner ~= ARGV[1] then return false end
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return tonumber(token)
end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. token, 'PX', ARGV[2])
return token
"""


class RolloutStore(Protocol):
    async def read_state(self, route: str) -> RolloutState | None: ...
    async def write_state(self, route: str, expected_gen: int, state: RolloutState, fence: int) -> bool: ...
    async def lead(self, owner: str, ttl_s: float) -> int | None: ...
    async def count(self, key: str, fields: Mapping[str, int], ttl_s: int) -> dict[str, int]: ...
    async def counts(self, key: str) -> dict[str, int]: ...
    async def record_arm(self, key: str, value: str, ttl_s: int) -> str: ...
    async def touch_arms(self, keys: Sequence[str], ttl_s: int) -> None: ...
    def changes(self) -> AsyncIterator[str | None]: ...
    async def close(self) -> None: ...


class RolloutKeys:
    """Key names under the store's prefix; arm keys are hashed (a sticky key may be a user's e-mail)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def state(self, route: str) -> str:
        return f"{self.prefix}:ro:state:{route}"

    def lock(self) -> str:
        return f"{self.prefix}:ro:lock"

    def fence(self) -> str:
        return f"{self.prefix}:ro:fence"

    def channel(self) -> str:
        return f"{self.prefix}:{CHANNEL}"

    def samples(self, rollout_id: str, run: int, window: int) -> str:
        return f"{self.prefix}:ro:n:{rollout_id}:{run}:{window}"

    def arm(self, rollout_id: str, run: int, sticky_key: str) -> str:
        digest = hashlib.sha256(sticky_key.encode()).hexdigest()[:32]
        return f"{self.prefix}:ro:arm:{rollout_id}:{run}:{digest}"


def encode_state(state: RolloutState) -> str:
    return json.dumps(state.to_dict(), separators=(",", ":"))


def decode_state(raw: str) -> RolloutState:
    return RolloutState.from_dict(json.loads(raw))


class RedisRolloutStore(RedisStore):
    """RolloutStore on Redis; every command bounded by the store's timeout and translated to StoreError."""

    def __init__(self, url: str, *, timeout_s: float = 0.25, prefix: str = "ag") -> None:
        super().__init__(url, timeout_s=timeout_s, prefix=prefix)
        self.keys = RolloutKeys(prefix)
        self._write_state = self._redis.register_script(WRITE_STATE)
        self._lead = self._redis.register_script(LEAD)

    async def read_state(self, route: str) -> RolloutState | None:
        raw = await self._run(self._redis.get(self.keys.state(route)))
        return None if raw is None else decode_state(str(raw))

    async def write_state(self, route: str, expected_gen: int, state: RolloutState, fence: int) -> bool:
        keys = [self.keys.state(route), self.keys.lock()]
        args: list[str | int] = [expected_gen, encode_state(state), fence, self.keys.channel(), route]
        return bool(await self._run(self._write_state(keys=keys, args=args)))

    async def lead(self, owner: str, ttl_s: float) -> int | None:
        token = await self._run(self._lead(keys=[self.keys.lock(), self.keys.fence()],
                                           args=[owner, int(ttl_s * 1000)]))
        return None if token is None else int(token)

    async def count(self, key: str, fields: Mapping[str, int], ttl_s: int) -> dict[str, int]:
        async with self._redis.pipeline(transaction=False) as pipe:
            for name, by in fields.items():
                pipe.hincrby(key, name, by)
            pipe.expire(key, ttl_s)
            totals = await self._run(pipe.execute())
        return {name: int(total) for name, total in zip(fields, totals, strict=False)}

    async def counts(self, key: str) -> dict[str, int]:
        raw = await self._run(self._redis.hgetall(key))
        return {str(k): int(v) for k, v in raw.items()}

    async def record_arm(self, key: str, value: str, ttl_s: int) -> str:
        previous = await self._run(self._redis.set(key, value, nx=True, get=True, ex=ttl_s))
        return value if previous is None else str(previous)

    async def touch_arms(self, keys: Sequence[str], ttl_s: int) -> None:
        async with self._redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.expire(key, ttl_s)
            await self._run(pipe.execute())

    async def changes(self) -> AsyncIterator[str | None]:
        pubsub = self._redis.pubsub()
        try:
            try:
                await pubsub.subscribe(self.keys.channel())
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    yield None if message is None else str(message["data"])
            except self._lib.failures as exc:
                raise StoreError(f"redis pub/sub: {type(exc).__name__}: {exc}") from exc
        finally:
            await _quietly_close(pubsub, self._lib.failures)


async def _quietly_close(pubsub: Any, failures: tuple[type[BaseException], ...]) -> None:
    with contextlib.suppress(*failures):  # the connection may already be gone
        await pubsub.aclose()
