"""Stored Responses API responses, keyed by (tenant, response id): the contract and its Redis store.

Contract (`RedisResponseStore` here, `response_memory.MemoryResponseStore` its in-process twin):

    put(record, limits)               keep it for limits.ttl_s; over max_per_tenant (that tenant's) or
                                      max_total (everyone's), the oldest records go first
    get(tenant, response_id) -> StoredResponse | None     None also for another tenant's id
    delete(tenant, response_id) -> bool                   False when that tenant has no such response
    close()

Redis keys (m = "tenant<TAB>response id"): `{p}:rs:r:{m}` the record's JSON (with its TTL), `{p}:rs:idx`
and `{p}:rs:idx:{tenant}` sorted sets of m by the time it was kept.

The limits are the policy's `store.responses` (24 hours, 10,000 a tenant, 100,000 in all by default). Why 24
hours: an agent chains each step onto the one before within seconds to minutes, and a person may resume a
conversation later the same day; a record holds the whole conversation up to it, so a day of an agent's chains
fits Redis' memory where OpenAI's 30 days would not. Operators who need longer set `ttl_s` there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from gateway.apis.responses.stored import StoredResponse
from gateway.store.redis_store import RedisStore

SEP = "\t"  # between tenant and response id: tenant names cannot hold it


MEMORY_BYTES = 256 * 1024 * 1024  # the in-memory store's bound (Redis has its own maxmemory)


@dataclass(frozen=True, slots=True)
class ResponseLimits:
    ttl_s: int
    max_per_tenant: int
    max_total: int
    max_memory_bytes: int = MEMORY_BYTES


class ResponseStore(Protocol):
    async def put(self, record: StoredResponse, limits: ResponseLimits) -> None: ...
    async def get(self, tenant: str, response_id: str) -> StoredResponse | None: ...
    async def delete(self, tenant: str, response_id: str) -> bool: ...
    async def close(self) -> None: ...


def member(tenant: str, response_id: str) -> str:
    return f"{tenant}{SEP}{response_id}"


# put: KEYS[1]=record, KEYS[2]=tenant index, KEYS[3]=global index; ARGV: record JSON, ttl_s, now, max per
#   tenant, max total, member, record key prefix, tenant index prefix -> records evicted. Evicted records'
#   keys are derived from their members (prefix .. member): one Redis, not a cluster.
PUT = """
local ttl, now, member = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[6]
redis.call('SET', KEYS[1], ARGV[1], 'EX', ttl)
for i = 2, 3 do
  redis.call('ZADD', KEYS[i], now, member)
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now - ttl)
  redis.call('EXPIRE', KEYS[i], ttl)
end
local evicted = 0
local function drop(popped, other_index)
  for j = 1, #popped, 2 do
    local m = popped[j]
    redis.call('DEL', ARGV[7] .. m)
    redis.call('ZREM', other_index(m), m)
    evicted = evicted + 1
  end
end
local over = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[4])
if over > 0 then drop(redis.call('ZPOPMIN', KEYS[2], over), function(m) return KEYS[3] end) end
over = redis.call('ZCARD', KEYS[3]) - tonumber(ARGV[5])
if over > 0 then
  drop(redis.call('ZPOPMIN', KEYS[3], over), function(m) return ARGV[8] .. string.match(m, '^([^\\t]*)') end)
end
return evicted
"""


class ResponseKeys:
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def record(self, tenant: str, response_id: str) -> str:
        return self.records() + member(tenant, response_id)

    def records(self) -> str:
        return f"{self.prefix}:rs:r:"

    def index(self, tenant: str | None = None) -> str:
        return f"{self.prefix}:rs:idx" if tenant is None else self.tenant_indexes() + tenant

    def tenant_indexes(self) -> str:
        return f"{self.prefix}:rs:idx:"


class RedisResponseStore(RedisStore):
    """ResponseStore on Redis: one script per put (kept, indexed, bounded atomically), every command bounded."""

    def __init__(self, url: str, *, timeout_s: float = 0.25, prefix: str = "ag") -> None:
        super().__init__(url, timeout_s=timeout_s, prefix=prefix)
        self.keys = ResponseKeys(prefix)
        self._put = self._redis.register_script(PUT)

    async def put(self, record: StoredResponse, limits: ResponseLimits) -> None:
        k, tenant = self.keys, record.tenant
        keys = [k.record(tenant, record.response_id), k.index(tenant), k.index()]
        args: list[str | int | float] = [
            record.to_json().decode(), limits.ttl_s, record.created_at, limits.max_per_tenant, limits.max_total,
            member(tenant, record.response_id), k.records(), k.tenant_indexes(),
        ]
        await self._run(self._put(keys=keys, args=args))

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        raw = await self._run(self._redis.get(self.keys.record(tenant, response_id)))
        return None if raw is None else StoredResponse.from_json(raw)

    async def delete(self, tenant: str, response_id: str) -> bool:
        name = member(tenant, response_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.keys.record(tenant, response_id))
            pipe.zrem(self.keys.index(tenant), name)
            pipe.zrem(self.keys.index(), name)
            replies = await self._run(pipe.execute())
        return bool(replies[0])
