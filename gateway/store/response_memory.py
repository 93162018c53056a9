"""The in-process twin of RedisResponseStore: the same contract over one ordered dict, for one process without Redis.

Records are kept as their JSON (what a caller does to an object it got back never changes what is kept, and
the byte bound is exact). Each method runs without awaiting, so on one event loop it is atomic.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from gateway.apis.responses.stored import StoredResponse
from gateway.store.responses import ResponseLimits

Ref = tuple[str, str]  # (tenant, response id)


class MemoryResponseStore:
    """Records oldest first; expired, and evicted over the count and byte bounds, on each put."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._records: OrderedDict[Ref, tuple[float, bytes]] = OrderedDict()  # -> (expires at, JSON)
        self._per_tenant: dict[str, OrderedDict[str, None]] = {}
        self._bytes = 0
        self._clock = clock

    async def put(self, record: StoredResponse, limits: ResponseLimits) -> None:
        ref = (record.tenant, record.response_id)
        self._drop(ref)
        raw = record.to_json()
        self._records[ref] = (record.created_at + limits.ttl_s, raw)
        self._per_tenant.setdefault(record.tenant, OrderedDict())[record.response_id] = None
        self._bytes += len(raw)
        self._expire()
        tenant = self._per_tenant[record.tenant]
        while len(tenant) > limits.max_per_tenant:
            self._drop((record.tenant, next(iter(tenant))))
        while self._records and (len(self._records) > limits.max_total or self._bytes > limits.max_memory_bytes):
            self._drop(next(iter(self._records)))

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        raw = self._live((tenant, response_id))
        return None if raw is None else StoredResponse.from_json(raw)

    async def delete(self, tenant: str, response_id: str) -> bool:
        return self._live((tenant, response_id)) is not None and self._drop((tenant, response_id))

    def _live(self, ref: Ref) -> bytes | None:
        """The record's JSON unless it is absent or expired (an expired one is dropped on the way)."""
        found = self._records.get(ref)
        if found is not None and found[0] <= self._clock():
            self._drop(ref)
            return None
        return None if found is None else found[1]

    async def close(self) -> None:
        return None

    def _drop(self, ref: Ref) -> bool:
        found = self._records.pop(ref, None)
        if found is None:
            return False
        self._bytes -= len(found[1])
        tenant = self._per_tenant.get(ref[0])
        if tenant is not None:
            tenant.pop(ref[1], None)
            if not tenant:
                del self._per_tenant[ref[0]]
        return True

    def _expire(self) -> None:
        """Drop expired records from the oldest on (kept in order of putting, so expiring in that order)."""
        now = self._clock()
        while self._records:
            ref, (expires_at, _) = next(iter(self._records.items()))
            if expires_at > now:
                return
            self._drop(ref)
