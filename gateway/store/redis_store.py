"""The shared store in Redis: one Lua script per operation, every command bounded (the contract: store/contract.py)."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Any, TypeVar

from gateway.decision.admission import SessionState, TenantSnapshot, window_bucket
from gateway.policy.tenancy import WINDOWS
from gateway.store import scripts as store_scripts
from gateway.store.contract import (
    BUCKET_FIELDS,
    NANO,
    Hold,
    KeyRecord,
    Layout,
    Limits,
    Observation,
    Refusal,
    Reservation,
    Spend,
    StoreBusy,
    StoreError,
    StoreFault,
    UsageRow,
    plan,
    refusal,
    to_nusd,
    usage_rows,
    window_usage,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

# Connections per process: commands beyond this wait for one (Redis runs one command at a time anyway,
# so more connections add no throughput, and a burst opening fewer at once keeps its connects in time).
MAX_CONNECTIONS = 32
POOL_TIMEOUT_S = 5.0
PUBSUB_CONNECTIONS = 2  # held outside the command slots (the rollout store's change feed)

# Refusals that mean the server cannot serve writes right now (a replica after failover, out of memory,
# loading, busy with a script, cluster down): an outage to wait out, unlike a refused command.
_OUTAGE_REPLIES = ("MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "BUSY", "MISCONF", "NOREPLICAS", "LOADING")


@dataclass(frozen=True, slots=True)
class RedisLibrary:
    """The parts of redis-py a store uses, imported when the first Redis store opens: redis-py weighs on a
    process's memory, and a gateway on its embedded store (the default) never loads it."""

    client: ModuleType  # redis.asyncio
    retry: type
    no_backoff: type
    connection_error: type[Exception]
    response_error: type[Exception]
    failures: tuple[type[BaseException], ...]  # a command that did not complete: the server, the socket, the clock
    outage_errors: tuple[type[Exception], ...]


@functools.cache
def redis_library() -> RedisLibrary:
    import redis.asyncio
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError, OutOfMemoryError, ReadOnlyError, RedisError, ResponseError

    return RedisLibrary(redis.asyncio, Retry, NoBackoff, ConnectionError, ResponseError,
                        (RedisError, OSError, TimeoutError), (ReadOnlyError, OutOfMemoryError))


class RedisStore:
    """The shared store: one Lua script per operation; every command bounded by `timeout_s`."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 0.25,
        prefix: str = "ag",
        clock: Callable[[], float] = time.time,
        max_connections: int = MAX_CONNECTIONS,
        pool_timeout_s: float = POOL_TIMEOUT_S,
    ) -> None:
        # redis.asyncio reconnects per command; one immediate retry covers a pooled connection that died
        # with a restarted server, and only on connection errors: a retried timeout could apply twice.
        # A full pool makes a command wait (never fail) for a connection: see _run.
        lib = self._lib = redis_library()
        pool = lib.client.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections + PUBSUB_CONNECTIONS,
            timeout=pool_timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=lib.retry(lib.no_backoff(), 1, supported_errors=(lib.connection_error,)),
            decode_responses=True,
        )
        self._redis = lib.client.Redis.from_pool(pool)
        self._slots = asyncio.Semaphore(max_connections)
        self._pool_timeout_s = pool_timeout_s
        self._outages = 0  # commands that failed for an outage; a waiter seeing it move gives up at once
        self._deadline_s = 3 * timeout_s + 0.05
        self._layout = Layout(prefix)
        self._clock = clock
        self._scripts = {
            name: self._redis.register_script(getattr(store_scripts, name))
            for name in ("RESERVE", "SETTLE", "RELEASE", "OBSERVE", "STEP")
        }

    async def _run(self, op: Awaitable[T]) -> T:
        """Wait (bounded) for a free connection, then run `op` under the command deadline.

        The wait is apart from the deadline: a burst larger than the pool queues here instead of failing
        (StoreBusy only past `pool_timeout_s`), and a command that fails for an outage while others wait
        fails them at once, so no request waits on a dead server for more than one command timeout.
        """
        outages = self._outages
        try:
            async with asyncio.timeout(self._pool_timeout_s):
                await self._slots.acquire()
        except TimeoutError:
            _discard(op)
            raise StoreBusy(f"no Redis connection free within {self._pool_timeout_s:g} s") from None
        try:
            if self._outages != outages:
                _discard(op)
                raise StoreError("redis: failed while this command waited for a connection")
            async with asyncio.timeout(self._deadline_s):
                return await op
        except self._lib.response_error as exc:
            if not _outage(exc, self._lib):
                raise StoreFault(f"redis refused the command: {exc}") from exc
            self._outages += 1
            raise StoreError(f"redis: {type(exc).__name__}: {exc}") from exc
        except self._lib.failures as exc:
            self._outages += 1
            raise StoreError(f"redis: {type(exc).__name__}: {exc}") from exc
        finally:
            self._slots.release()

    async def _script(self, name: str, keys: list[str], args: list[Any]) -> Any:
        return await self._run(self._scripts[name](keys=keys, args=args))

    async def reserve(self, hold: Hold) -> Reservation | Refusal:
        now_s, lay = self._clock(), self._layout
        plans = plan(lay, hold.tenant, hold.limits, now_s)
        rid, cost_nusd = hold.id, to_nusd(hold.cost.usd)
        expires_ms = int((now_s + hold.ttl_s) * 1000)
        session_key = lay.session(hold.tenant, hold.session_id or "")
        keys = [lay.reservations(hold.tenant), lay.records(hold.tenant), lay.tenants(), session_key]
        args: list[Any] = [
            int(now_s * 1000), expires_ms, rid, cost_nusd, hold.cost.tokens,
            -1 if hold.limits.max_concurrent is None else hold.limits.max_concurrent,
            hold.deployment, hold.tenant, int(hold.session_id is not None), hold.session_ttl_s,
        ]  # fmt: skip
        for p in plans:
            keys.append(p.key)
            args += [f"usd_per_{p.window}", p.hard_nusd, f"tokens_per_{p.window}", p.hard_tokens,
                     p.hard_requests, p.expire_at_s]  # fmt: skip
        result = await self._script("RESERVE", keys, args)
        if int(result[0]) == 0:
            return refusal(str(result[1]), plans, now_s)
        return Reservation(
            rid,
            hold.tenant,
            hold.deployment,
            cost_nusd / NANO,
            hold.cost.tokens,
            expires_ms / 1000,
            hold.session_id,
        )

    async def settle(self, reservation: Reservation, spend: Spend) -> bool:
        lay, t = self._layout, reservation.tenant
        plans = plan(lay, t, Limits(), self._clock())
        keys = [
            lay.reservations(t),
            lay.records(t),
            lay.session(t, reservation.session_id or ""),
            *(p.key for p in plans),
        ]
        args: list[Any] = [
            reservation.id, to_nusd(spend.usd), spend.tokens_in, spend.tokens_out, reservation.deployment,
            int(reservation.session_id is not None), *(p.expire_at_s for p in plans),
        ]  # fmt: skip
        return bool(await self._script("SETTLE", keys, args))

    async def release(self, reservation: Reservation) -> bool:
        t = reservation.tenant
        keys = [self._layout.reservations(t), self._layout.records(t)]
        return bool(await self._script("RELEASE", keys, [reservation.id]))

    async def observe(
        self, tenant: str, session_id: str | None, rate_window_s: float = 30.0, idle_ttl_s: int = 3600
    ) -> Observation:
        now_s, lay = self._clock(), self._layout
        plans = plan(lay, tenant, Limits(), now_s)
        keys = [lay.reservations(tenant), lay.records(tenant), *(p.key for p in plans)]
        args: list[Any] = [int(now_s * 1000)]
        if session_id is not None:
            keys += [lay.session(tenant, session_id), lay.steps(tenant, session_id)]
            args += [int(rate_window_s * 1000), idle_ttl_s, f"{args[0]}:{secrets.token_hex(4)}"]
        result = await self._script("OBSERVE", keys, args)
        windows = {
            p.window: window_usage(p.window, p.ends_at_s, dict(zip(BUCKET_FIELDS, row, strict=True)))
            for p, row in zip(plans, result[1:5], strict=True)
        }
        snapshot = TenantSnapshot(tenant, now_s, windows, int(result[0]))
        session = None if session_id is None else _session(session_id, result[5], rate_window_s)
        return Observation(snapshot, session)

    async def snapshot(self, tenant: str) -> TenantSnapshot:
        return (await self.observe(tenant, None)).snapshot

    async def step(self, tenant: str, session_id: str, rate_window_s: float, idle_ttl_s: int) -> SessionState:
        now_ms = int(self._clock() * 1000)
        keys = [self._layout.session(tenant, session_id), self._layout.steps(tenant, session_id)]
        args = [now_ms, int(rate_window_s * 1000), idle_ttl_s, f"{now_ms}:{secrets.token_hex(4)}"]
        return _session(session_id, await self._script("STEP", keys, args), rate_window_s)

    async def usage(self, tenant: str | None = None) -> list[UsageRow]:
        now_s, lay = self._clock(), self._layout
        if tenant is not None:
            tenants = [tenant]
        else:
            tenants = sorted(str(t) for t in await self._run(self._redis.smembers(lay.tenants())))
        rows: list[UsageRow] = []
        for t in tenants:
            for window in WINDOWS:
                bucket_id, _ = window_bucket(window, now_s)
                fields = _strs(await self._run(self._redis.hgetall(lay.bucket(t, window, bucket_id))))
                rows += usage_rows(t, window, bucket_id, fields)
        return rows

    async def put_key(self, record: KeyRecord) -> None:
        mapping: dict[Any, Any] = {k: str(v) for k, v in asdict(record).items()}
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._layout.key(record.digest), mapping=mapping)
            pipe.hset(self._layout.key_ids(), record.key_id, record.digest)
            await self._run(pipe.execute())

    async def find_key(self, digest: str) -> KeyRecord | None:
        fields = _strs(await self._run(self._redis.hgetall(self._layout.key(digest))))
        return _key_record(fields) if fields else None

    async def list_keys(self) -> list[KeyRecord]:
        digests = await self._run(self._redis.hvals(self._layout.key_ids()))
        found = [await self.find_key(str(d)) for d in digests]
        return sorted((r for r in found if r is not None), key=lambda r: r.created_s)

    async def delete_key(self, key_id: str) -> KeyRecord | None:
        digest = await self._run(self._redis.hget(self._layout.key_ids(), key_id))
        if digest is None:
            return None
        digest = str(digest)
        record = await self.find_key(digest)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._layout.key(digest))
            pipe.hdel(self._layout.key_ids(), key_id)
            await self._run(pipe.execute())
        return record

    async def ping(self) -> None:
        await self._run(self._redis.ping())

    async def close(self) -> None:
        await self._redis.aclose()


def _discard(op: Awaitable[Any]) -> None:
    """Close a command coroutine that will not run (it would warn 'never awaited')."""
    if inspect.iscoroutine(op):
        op.close()


def _outage(exc: Exception, lib: RedisLibrary) -> bool:
    return isinstance(exc, lib.outage_errors) or str(exc).startswith(_OUTAGE_REPLIES)


def _session(session_id: str, row: list[Any], rate_window_s: float) -> SessionState:
    steps, recent, cost_nusd, pinned = row
    return SessionState(
        session_id, int(steps), int(recent) * 60.0 / rate_window_s, int(cost_nusd) / NANO, pinned or None
    )


def _strs(fields: Mapping[Any, Any]) -> dict[str, str]:
    return {str(k): str(v) for k, v in fields.items()}


def _key_record(fields: Mapping[str, str]) -> KeyRecord:
    return KeyRecord(
        fields["key_id"],
        fields["tenant"],
        fields["prefix"],
        fields["digest"],
        float(fields["created_s"]),
        fields.get("name", ""),
    )
