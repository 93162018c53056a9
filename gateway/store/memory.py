"""The in-memory twin of RedisStore: the same keys, the same script logic, one process, no Redis.

Each method runs without awaiting in between, so on one event loop it is as atomic as a Lua script.
The logic mirrors gateway/store/scripts.py line by line; tests/store/test_store.py runs one behavioural
table against both stores to keep them identical.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from gateway.decision.admission import SessionState, TenantSnapshot, window_bucket
from gateway.policy.tenancy import WINDOWS
from gateway.store.contract import (
    NANO,
    Hold,
    KeyRecord,
    Layout,
    Limits,
    Observation,
    Refusal,
    Reservation,
    Spend,
    UsageRow,
    new_reservation_id,
    plan,
    refusal,
    to_nusd,
    usage_rows,
    window_usage,
)
from gateway.store.keyspace import MAX_KEYS, Keyspace


class MemoryStore:
    """One replica's store; also the local accounting FallbackStore uses while Redis is down."""

    origin = "local"

    def __init__(
        self, *, prefix: str = "ag", clock: Callable[[], float] = time.time, max_keys: int = MAX_KEYS
    ) -> None:
        self._layout = Layout(prefix)
        # over the bound, idle sessions go first; budget buckets, holds and keys are never evicted
        self._ks = Keyspace(clock, max_keys=max_keys, evictable=self._layout.is_session)
        self._clock = clock

    def _unhold(self, tenant: str, rid: str) -> list[str] | None:
        """The reservation's buckets that still exist, or None when it is not open."""
        ks, lay = self._ks, self._layout
        zset, records = ks.zset(lay.reservations(tenant)), ks.hash(lay.records(tenant))
        zset.pop(rid, None)
        rec = records.pop(rid, None)
        if rec is None:
            return None
        p: list[str] = rec.split()
        cost, tokens, live = int(p[0]), int(p[1]), []
        for key in p[2::2]:
            h = ks.get(key)
            if h is not None:
                h["rusd"] = h.get("rusd", 0) - cost
                h["rtok"] = h.get("rtok", 0) - tokens
                live.append(key)
        return live

    def _expire_stale(self, tenant: str, now_ms: int) -> None:
        zset = self._ks.zset(self._layout.reservations(tenant))
        stale = [r for r, at in zset.items() if at <= now_ms]
        for rid in sorted(stale, key=zset.__getitem__)[:200]:
            self._unhold(tenant, rid)

    async def reserve(self, hold: Hold) -> Reservation | Refusal:
        now_s, ks, lay = self._clock(), self._ks, self._layout
        ks.tidy()
        plans = plan(lay, hold.tenant, hold.limits, now_s)
        self._expire_stale(hold.tenant, int(now_s * 1000))
        cost, tokens = to_nusd(hold.cost.usd), hold.cost.tokens
        limit = self._first_crossed(hold, plans, cost, tokens)
        if limit is not None:
            return refusal(limit, plans, now_s)
        rid, expires_ms = new_reservation_id(), int((now_s + hold.ttl_s) * 1000)
        rec = [str(cost), str(tokens)]
        for p in plans:
            h = ks.hash(p.key)
            h["rusd"] = h.get("rusd", 0) + cost
            h["rtok"] = h.get("rtok", 0) + tokens
            h["req"] = h.get("req", 0) + 1
            if h["req"] == 1:
                ks.expire(p.key, p.expire_at_s)
            rec += [p.key, str(p.expire_at_s)]
        ks.zset(lay.reservations(hold.tenant))[rid] = expires_ms
        ks.hash(lay.records(hold.tenant))[rid] = " ".join(rec)
        for key in (lay.reservations(hold.tenant), lay.records(hold.tenant)):
            at_s = expires_ms / 1000 + 60  # as in Redis: the tenant's holds outlive their last expiry
            if ks.expire_at.get(key, 0.0) < at_s:
                ks.expire(key, at_s)
        if hold.session_id is not None:
            ks.expire(lay.session(hold.tenant, hold.session_id), now_s + hold.session_ttl_s)
        ks.data.setdefault(lay.tenants(), set()).add(hold.tenant)
        return Reservation(
            rid,
            hold.tenant,
            hold.deployment,
            cost / NANO,
            tokens,
            expires_ms / 1000,
            hold.session_id,
            "local",
        )

    def _first_crossed(self, hold: Hold, plans: list[Any], cost: int, tokens: int) -> str | None:
        limits: Limits = hold.limits
        live = self._ks.zset(self._layout.reservations(hold.tenant))
        if limits.max_concurrent is not None and len(live) >= limits.max_concurrent:
            return "concurrent"
        for p in plans:
            h = self._ks.get(p.key) or {}
            usd = int(h.get("usd", 0)) + int(h.get("rusd", 0))
            tok = int(h.get("tok", 0)) + int(h.get("rtok", 0))
            if p.hard_requests >= 0 and int(h.get("req", 0)) + 1 > p.hard_requests:
                return "requests_per_minute"
            if p.hard_nusd >= 0 and usd + cost > p.hard_nusd:
                return f"usd_per_{p.window}"
            if p.hard_tokens >= 0 and tok + tokens > p.hard_tokens:
                return f"tokens_per_{p.window}"
        return None

    async def settle(self, reservation: Reservation, spend: Spend) -> bool:
        ks, lay, t = self._ks, self._layout, reservation.tenant
        ks.tidy()
        live = self._unhold(t, reservation.id)
        targets: list[tuple[str, float | None]]
        if live is not None:
            targets = [(key, None) for key in live]
        else:
            targets = [(b.key, float(b.expire_at_s)) for b in plan(lay, t, Limits(), self._clock())]
        cost, d = to_nusd(spend.usd), f"d:{reservation.deployment}:"
        adds = {
            "usd": cost, "tok": spend.tokens_in + spend.tokens_out, d + "usd": cost,
            d + "in": spend.tokens_in, d + "out": spend.tokens_out, d + "req": 1,
        }  # fmt: skip
        for key, at in targets:
            h = ks.hash(key)
            for name, by in adds.items():
                h[name] = h.get(name, 0) + by
            if at is not None:
                ks.expire(key, at)
        if reservation.session_id is not None:
            session_key = lay.session(t, reservation.session_id)
            if ks.get(session_key) is not None:
                ks.hincr(session_key, "cost", cost)
                ks.hash(session_key).setdefault("pinned", reservation.deployment)  # the one that answered
        return live is not None

    async def release(self, reservation: Reservation) -> bool:
        self._ks.tidy()
        return self._unhold(reservation.tenant, reservation.id) is not None

    async def observe(
        self, tenant: str, session_id: str | None, rate_window_s: float = 30.0, idle_ttl_s: int = 3600
    ) -> Observation:
        snapshot = await self.snapshot(tenant)
        session = (
            None if session_id is None else await self.step(tenant, session_id, rate_window_s, idle_ttl_s)
        )
        return Observation(snapshot, session)

    async def snapshot(self, tenant: str) -> TenantSnapshot:
        now_s = self._clock()
        self._ks.tidy()
        self._expire_stale(tenant, int(now_s * 1000))
        plans = plan(self._layout, tenant, Limits(), now_s)
        windows = {p.window: window_usage(p.window, p.ends_at_s, self._ks.get(p.key) or {}) for p in plans}
        return TenantSnapshot(tenant, now_s, windows, len(self._ks.zset(self._layout.reservations(tenant))))

    async def step(self, tenant: str, session_id: str, rate_window_s: float, idle_ttl_s: int) -> SessionState:
        now_s, ks = self._clock(), self._ks
        ks.tidy()
        now_ms, key, steps_key = (
            int(now_s * 1000),
            self._layout.session(tenant, session_id),
            self._layout.steps(tenant, session_id),
        )
        steps = ks.hincr(key, "steps", 1)
        # step times arrive in clock order, so a bounded deque is the sorted set here
        times = ks.get(steps_key)
        if times is None:
            times = ks.data[steps_key] = deque(maxlen=1000)
        times.append(now_ms)
        while times and times[0] <= now_ms - rate_window_s * 1000:
            times.popleft()
        ks.expire(key, now_s + idle_ttl_s)
        ks.expire(steps_key, now_s + idle_ttl_s)
        h = ks.hash(key)
        pinned = h.get("pinned")
        return SessionState(
            session_id, steps, len(times) * 60.0 / rate_window_s, int(h.get("cost", 0)) / NANO, pinned
        )

    async def usage(self, tenant: str | None = None) -> list[UsageRow]:
        now_s = self._clock()
        tenants = [tenant] if tenant is not None else sorted(self._ks.get(self._layout.tenants()) or ())
        rows: list[UsageRow] = []
        for t in tenants:
            for window in WINDOWS:
                bucket_id, _ = window_bucket(window, now_s)
                fields = self._ks.get(self._layout.bucket(t, window, bucket_id)) or {}
                rows += usage_rows(t, window, bucket_id, fields)
        return rows

    async def put_key(self, record: KeyRecord) -> None:
        self._ks.data[self._layout.key(record.digest)] = {k: str(v) for k, v in asdict(record).items()}
        self._ks.hash(self._layout.key_ids())[record.key_id] = record.digest

    async def find_key(self, digest: str) -> KeyRecord | None:
        fields = self._ks.get(self._layout.key(digest))
        if not fields:
            return None
        return KeyRecord(
            fields["key_id"],
            fields["tenant"],
            fields["prefix"],
            fields["digest"],
            float(fields["created_s"]),
            fields["name"],
        )

    async def list_keys(self) -> list[KeyRecord]:
        found = [await self.find_key(d) for d in self._ks.hash(self._layout.key_ids()).values()]
        return sorted((r for r in found if r is not None), key=lambda r: r.created_s)

    async def delete_key(self, key_id: str) -> KeyRecord | None:
        digest = self._ks.hash(self._layout.key_ids()).pop(key_id, None)
        if digest is None:
            return None
        record = await self.find_key(digest)
        self._ks.delete(self._layout.key(digest))
        return record

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def dump(self) -> dict[str, Any]:
        """Every live key and value (tests scan it for secrets, as they SCAN Redis)."""
        return {k: v for k in list(self._ks.data) if (v := self._ks.get(k)) is not None}
