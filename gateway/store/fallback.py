"""FallbackStore: the shared store while it answers; local accounting or StoreUnavailable while it does not.

`on_unavailable="allow"` serves budgets, sessions and usage from a local MemoryStore while Redis is
down (each replica then enforces the limits on its own share of traffic, so a fleet of N replicas may
spend up to N budgets during the outage), queues every settle (and release) that could not reach Redis
and replays it when Redis answers again, so the shared ledger ends up with the real spend. `"reject"` raises
`errors.StoreUnavailable` (503). Either way a down Redis is probed at most once per `retry_s`, by one
request at a time, so no request waits on a dead server more than one command timeout. A busy Redis (no
pooled connection free in time: `StoreBusy`) is not down: the request gets 503 `store_busy` and the
ledger stays whole. API keys never
fall back: a key unknown to the shared store cannot be checked locally (keys.KeyRing serves its cache).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Literal, TypeVar

from gateway.decision.admission import SessionState, TenantSnapshot
from gateway.errors import StoreUnavailable
from gateway.store.contract import (
    Hold,
    KeyRecord,
    Observation,
    Refusal,
    Reservation,
    Spend,
    Store,
    StoreBusy,
    StoreError,
    UsageRow,
    interrupted,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

PENDING_MAX = 100_000  # settles kept for replay; beyond this the oldest are dropped (and counted)


class FallbackStore:
    def __init__(
        self,
        shared: Store,
        local: Store,
        *,
        on_unavailable: Literal["allow", "reject"] = "allow",
        retry_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._shared, self._local = shared, local
        self._allow = on_unavailable == "allow"
        self._retry_s, self._clock = retry_s, clock
        self._down_since: float | None = None
        self._next_probe = 0.0
        self._probing = False
        self._pending: deque[tuple[Reservation, Spend | None]] = deque(maxlen=PENDING_MAX)  # None: release
        self._replay: asyncio.Task[None] | None = None
        self.dropped_settles = 0

    @property
    def degraded(self) -> bool:
        """True while the shared store is considered down."""
        return self._down_since is not None

    def _try_shared(self) -> bool:
        if self._down_since is None:
            return True
        if self._probing or self._clock() < self._next_probe:
            return False
        self._probing = True
        return True

    def _mark_down(self, exc: StoreError) -> None:
        if self._down_since is None:
            self._down_since = self._clock()
            log.warning(
                "shared store unreachable (%s); %s", exc, "local accounting" if self._allow else "rejecting"
            )
        self._next_probe = self._clock() + self._retry_s

    def _mark_up(self) -> None:
        if self._down_since is not None:
            log.warning("shared store back after %.1f s", self._clock() - self._down_since)
            self._down_since = None
            if self._pending and self._replay is None:
                self._replay = asyncio.get_running_loop().create_task(self._replay_pending())

    async def _run(
        self, call: Callable[[Store], Awaitable[T]], *, local_ok: bool = True, undo: Callable[[], None] | None = None
    ) -> T:
        """`call` on the shared store, else (allowed, `local_ok`) on the local one. `undo` runs when the shared
        call was cut off (failed or cancelled) after it may have reached Redis."""
        exc: StoreError | None = None
        if self._try_shared():
            try:
                result = await call(self._shared)
            except StoreBusy as err:  # Redis answers, slowly: local accounting would split the ledger
                # (busy means no connection was free: the command was never sent, there is nothing to undo)
                raise StoreUnavailable("The shared store is busy; retry shortly", code="store_busy") from err
            except StoreError as err:
                exc = err
                self._mark_down(err)
                if undo is not None:
                    undo()
            except asyncio.CancelledError:
                if undo is not None:
                    undo()
                raise
            else:
                self._mark_up()
                return result
            finally:
                self._probing = False
        if self._allow and local_ok:
            return await call(self._local)
        raise StoreUnavailable("The shared store is unreachable; retry shortly") from exc

    async def reserve(self, hold: Hold) -> Reservation | Refusal:
        """Hold in Redis, else locally. A shared reserve cut off by its deadline or a cancel may have run in
        Redis all the same: its id is released there (queued like a settle, so in the background and
        replayed once Redis answers), so the hold never counts twice (Redis and local) or leaks until its TTL.
        """
        return await self._run(lambda s: s.reserve(hold), undo=lambda: self._queue(interrupted(hold), None))

    async def settle(self, reservation: Reservation, spend: Spend) -> bool:
        if reservation.origin == "local":
            found = await self._local.settle(reservation, spend)
            self._queue(reservation, spend)  # the shared ledger learns the spend once Redis is back
            return found
        try:
            return await self._run(lambda s: s.settle(reservation, spend), local_ok=False)
        except StoreUnavailable:
            self._queue(reservation, spend)
            return False

    async def release(self, reservation: Reservation) -> bool:
        if reservation.origin == "local":
            return await self._local.release(reservation)
        try:
            return await self._run(lambda s: s.release(reservation), local_ok=False)
        except StoreUnavailable:
            self._queue(reservation, None)  # freed when Redis answers again, else it expires after its TTL
            return False

    def _queue(self, reservation: Reservation, spend: Spend | None) -> None:
        if len(self._pending) == self._pending.maxlen:
            self.dropped_settles += 1
        self._pending.append((reservation, spend))
        if self._down_since is None and self._replay is None:
            self._replay = asyncio.get_running_loop().create_task(self._replay_pending())

    async def _replay_pending(self) -> None:
        try:
            while self._pending and self._down_since is None:
                reservation, spend = self._pending[0]
                try:
                    if spend is None:
                        await self._shared.release(reservation)
                    else:
                        await self._shared.settle(reservation, spend)
                except StoreBusy:
                    await asyncio.sleep(self._retry_s)
                    continue
                except StoreError as exc:
                    self._mark_down(exc)
                    return
                self._pending.popleft()
        finally:
            self._replay = None

    async def observe(
        self, tenant: str, session_id: str | None, rate_window_s: float = 30.0, idle_ttl_s: int = 3600
    ) -> Observation:
        return await self._run(lambda s: s.observe(tenant, session_id, rate_window_s, idle_ttl_s))

    async def snapshot(self, tenant: str) -> TenantSnapshot:
        return await self._run(lambda s: s.snapshot(tenant))

    async def step(self, tenant: str, session_id: str, rate_window_s: float, idle_ttl_s: int) -> SessionState:
        return await self._run(lambda s: s.step(tenant, session_id, rate_window_s, idle_ttl_s))

    async def usage(self, tenant: str | None = None) -> list[UsageRow]:
        return await self._run(lambda s: s.usage(tenant))

    async def put_key(self, record: KeyRecord) -> None:
        await self._run(lambda s: s.put_key(record), local_ok=False)

    async def find_key(self, digest: str) -> KeyRecord | None:
        return await self._run(lambda s: s.find_key(digest), local_ok=False)

    async def list_keys(self) -> list[KeyRecord]:
        return await self._run(lambda s: s.list_keys(), local_ok=False)

    async def delete_key(self, key_id: str) -> KeyRecord | None:
        return await self._run(lambda s: s.delete_key(key_id), local_ok=False)

    async def ping(self) -> None:
        await self._run(lambda s: s.ping(), local_ok=False)

    async def close(self) -> None:
        if self._replay is not None:
            self._replay.cancel()
        await self._shared.close()
        await self._local.close()

    @property
    def pending_settles(self) -> int:
        return len(self._pending)
