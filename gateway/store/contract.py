"""The store contract and its records (no redis import): shared accounting state (budgets, sessions, keys, usage).

Contract (every store, `RedisStore` here and `store_memory.MemoryStore`, implements `Store`):

    reserve(hold: Hold) -> Reservation | Refusal     atomic, all-or-nothing across every window,
                                                      the request-rate and the concurrency limits
    settle(reservation, spend: Spend) -> bool        frees the hold, records the actual spend
    release(reservation) -> bool                     frees the hold, records nothing
    observe(tenant, session_id | None, rate_window_s, idle_ttl_s) -> Observation
                                                      snapshot + session step in one round trip
    snapshot(tenant) -> TenantSnapshot               current buckets and open reservations
    step(tenant, session_id, rate_window_s, idle_ttl_s) -> SessionState
    usage(tenant | None) -> list[UsageRow]
    put_key / find_key(digest) / list_keys / delete_key(key_id)
    ping(), close()

Amounts are kept as integer nano-USD so that sums are exact. Reservations carry an id and an expiry
kept in a per-tenant sorted set; every script that reads a tenant's limits first undoes the holds
whose expiry passed, so a crashed replica's reservations free themselves. Only `StoreError` (chained
`from` the redis exception) leaves a store for an outage; `FallbackStore` turns it into local
accounting (`allow`) or `errors.StoreUnavailable` (`reject`), and probes Redis again every `retry_s`.
A command Redis refuses (a script error: a bug, not an outage) raises `StoreFault`, which no fallback
hides.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
import secrets
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, NamedTuple, Protocol, TypeVar

from gateway.decision.admission import Cost, SessionState, TenantSnapshot, WindowUsage, window_bucket
from gateway.errors import StoreUnavailable
from gateway.policy.tenancy import WINDOWS, TenantPolicy, Window

log = logging.getLogger(__name__)
T = TypeVar("T")

NANO = 1_000_000_000
BUCKET_FIELDS = ("usd", "rusd", "tok", "rtok", "req")
# How long a bucket outlives its window, so `usage` can still show a window that just ended.
RETENTION_S = {Window.MINUTE: 120, Window.HOUR: 86400, Window.DAY: 8 * 86400, Window.MONTH: 62 * 86400}


def to_nusd(usd: float) -> int:
    """USD to integer nano-USD, rounded up so a reservation never undercounts."""
    return math.ceil(round(usd * NANO, 3))


class StoreError(Exception):
    """The store could not answer (unreachable, timed out, protocol error)."""


class StoreBusy(StoreError):
    """Every pooled connection stayed busy past the wait deadline: Redis is slow, not down (no fallback)."""


class StoreFault(Exception):
    """The store answered but refused the command (a script or argument bug): not an outage, so no fallback."""


@contextlib.contextmanager
def reported_as_unavailable(what: str) -> Iterator[None]:
    """The one translation of a store failure for a client: StoreError becomes a 503 naming `what`."""
    try:
        yield
    except StoreError as exc:
        raise StoreUnavailable(f"{what} is unreachable: {exc}") from exc


@dataclass(frozen=True, slots=True)
class Limits:
    """One tenant's hard limits as the store enforces them; None means unlimited."""

    usd: Mapping[Window, float] = field(default_factory=dict)
    tokens: Mapping[Window, int] = field(default_factory=dict)
    requests_per_minute: int | None = None
    max_concurrent: int | None = None
    # (hard nano-USD, hard tokens, hard requests) per window in WINDOWS order, -1 for none; derived once
    hard: tuple[tuple[int, int, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        hard = []
        for window in WINDOWS:
            usd, tokens = self.usd.get(window), self.tokens.get(window)
            rpm = self.requests_per_minute if window is Window.MINUTE else None
            hard.append(
                (
                    -1 if usd is None else to_nusd(usd),
                    -1 if tokens is None else tokens,
                    -1 if rpm is None else rpm,
                )
            )
        object.__setattr__(self, "hard", tuple(hard))

    @classmethod
    def of(cls, tenant: TenantPolicy | None) -> Limits:
        if tenant is None:
            return NO_LIMITS
        # keyed by identity, not by hash: hashing a pydantic model costs more than the whole reserve
        hit = _LIMITS.get(id(tenant))
        if hit is not None and hit[0] is tenant:
            return hit[1]
        if len(_LIMITS) > 1024:
            _LIMITS.clear()
        limits = _limits_of(tenant)
        _LIMITS[id(tenant)] = (tenant, limits)
        return limits


_LIMITS: dict[int, tuple[TenantPolicy, Limits]] = {}


def _limits_of(tenant: TenantPolicy) -> Limits:
    usd = {b.window: b.hard_usd for b in tenant.budgets if b.hard_usd is not None}
    tokens = {b.window: b.hard_tokens for b in tenant.budgets if b.hard_tokens is not None}
    if tenant.tokens_per_minute is not None:
        tokens[Window.MINUTE] = min(
            tokens.get(Window.MINUTE, tenant.tokens_per_minute), tenant.tokens_per_minute
        )
    return Limits(usd, tokens, tenant.requests_per_minute, tenant.max_concurrent)


NO_LIMITS = Limits()


def new_reservation_id() -> str:
    return secrets.token_hex(8)


@dataclass(frozen=True, slots=True)
class Hold:
    """What reserve is asked to hold for one request.

    Its id is chosen before the shared store sees it: a reserve interrupted after Redis ran it (the caller
    cancelled, the deadline fired while the reply was on its way) can then still be undone, by releasing
    `interrupted(hold)`; a reserve of an id already held holds nothing more. (The in-memory store names
    its own: a reserve there runs without a pause, so nothing can interrupt it.)
    """

    tenant: str
    deployment: str
    cost: Cost  # the worst case
    limits: Limits = Limits()
    session_id: str | None = None  # the session whose step this is (its settle pins it, see Reservation)
    ttl_s: float = 900.0
    session_ttl_s: int = 3600
    id: str = field(default_factory=new_reservation_id)


@dataclass(frozen=True, slots=True)
class Reservation:
    id: str
    tenant: str
    deployment: str
    cost_usd: float
    tokens: int
    expires_at_s: float
    session_id: str | None = None  # settle pins it to the deployment that answered, if it has no pin yet
    origin: Literal["shared", "local"] = "shared"


def interrupted(hold: Hold) -> Reservation:
    """The shared reservation an interrupted reserve of `hold` may have made: releasing it undoes that reserve
    if it ran, and is a no-op if it did not."""
    return Reservation(hold.id, hold.tenant, hold.deployment, hold.cost.usd, hold.cost.tokens, 0.0, hold.session_id)


@dataclass(frozen=True, slots=True)
class Refusal:
    limit: str  # "usd_per_day", "tokens_per_minute", "requests_per_minute", "concurrent" …
    retry_after_s: float


@dataclass(frozen=True, slots=True)
class Spend:
    """Actual usage of a finished request."""

    usd: float
    tokens_in: int
    tokens_out: int


@dataclass(frozen=True, slots=True)
class UsageRow:
    tenant: str
    window: Window
    bucket: str
    deployment: str  # "*" for the tenant's total
    spend_usd: float
    tokens_in: int
    tokens_out: int
    requests: int
    reserved_usd: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "window": str(self.window)}


@dataclass(frozen=True, slots=True)
class Observation:
    """Everything admission reads, from one round trip: the tenant's windows and the session's step."""

    snapshot: TenantSnapshot
    session: SessionState | None


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """An API key as stored: never the key itself, only its digest."""

    key_id: str
    tenant: str
    prefix: str
    digest: str
    created_s: float
    name: str = ""


class BucketPlan(NamedTuple):
    """One window bucket a reserve touches, with the hard limits that apply to it (-1: none)."""

    window: Window
    key: str
    ends_at_s: float
    expire_at_s: int
    hard_nusd: int
    hard_tokens: int
    hard_requests: int


class Layout:
    """Key names; every key of a tenant shares the hash tag {tenant} so one script touches one slot."""

    def __init__(self, prefix: str = "ag") -> None:
        self.prefix = prefix

    def bucket(self, tenant: str, window: Window, bucket_id: str) -> str:
        return f"{self.prefix}:{{{tenant}}}:w:{window}:{bucket_id}"

    def reservations(self, tenant: str) -> str:
        return f"{self.prefix}:{{{tenant}}}:res"

    def records(self, tenant: str) -> str:
        return f"{self.prefix}:{{{tenant}}}:rec"

    def session(self, tenant: str, session_id: str) -> str:
        # hashed: a session id may be a user's e-mail or arbitrary header bytes
        return f"{self.prefix}:{{{tenant}}}:s:{_digest(session_id)}"

    def steps(self, tenant: str, session_id: str) -> str:
        return f"{self.prefix}:{{{tenant}}}:st:{_digest(session_id)}"

    def is_session(self, key: str) -> bool:
        """A session's hash or step times (a tenant name holds no ':', so the marker is unambiguous)."""
        return "}:s:" in key or "}:st:" in key

    def tenants(self) -> str:
        return f"{self.prefix}:tenants"

    def key(self, digest: str) -> str:
        return f"{self.prefix}:key:{digest}"

    def key_ids(self) -> str:
        return f"{self.prefix}:keyids"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def plan(layout: Layout, tenant: str, limits: Limits, now_s: float) -> list[BucketPlan]:
    """The current bucket of every window with its hard limits."""
    buckets = _buckets(layout.prefix, tenant, math.floor(now_s / 60))
    return [BucketPlan(*b, *hard) for b, hard in zip(buckets, limits.hard, strict=True)]


@functools.lru_cache(maxsize=1024)
def _buckets(prefix: str, tenant: str, minute: int) -> tuple[tuple[Window, str, float, int], ...]:
    # the hot path asks for the same keys all minute long: build them once per tenant and minute
    layout, out = Layout(prefix), []
    for window in WINDOWS:
        bucket_id, ends_at_s = window_bucket(window, minute * 60.0)
        out.append(
            (
                window,
                layout.bucket(tenant, window, bucket_id),
                ends_at_s,
                int(ends_at_s) + RETENTION_S[window],
            )
        )
    return tuple(out)


def refusal(limit: str, plans: list[BucketPlan], now_s: float) -> Refusal:
    """The retry-after of a refused reserve: the end of the refusing window; 1 s for concurrency."""
    if limit == "concurrent":
        return Refusal(limit, 1.0)
    window = Window(limit.rsplit("_", 1)[1])
    ends = next(p.ends_at_s for p in plans if p.window is window)
    return Refusal(limit, max(0.0, ends - now_s))


def window_usage(window: Window, ends_at_s: float, fields: Mapping[str, Any]) -> WindowUsage:
    """A bucket hash (usd, rusd, tok, rtok, req) as WindowUsage."""

    def num(name: str) -> int:
        value = fields.get(name)
        return int(value) if value is not None else 0

    return WindowUsage(
        window, num("usd") / NANO, num("rusd") / NANO, num("tok"), num("rtok"), num("req"), ends_at_s
    )


def usage_rows(tenant: str, window: Window, bucket_id: str, fields: Mapping[str, Any]) -> list[UsageRow]:
    """A bucket hash as one total row ("*") plus one row per deployment that settled in it."""
    per: dict[str, dict[str, int]] = {}
    for name, value in fields.items():
        if name.startswith("d:"):
            deployment, _, what = name[2:].rpartition(":")
            per.setdefault(deployment, {})[what] = int(value)
    w = window_usage(window, 0.0, fields)
    total_in = sum(d.get("in", 0) for d in per.values())
    rows = [
        UsageRow(
            tenant,
            window,
            bucket_id,
            "*",
            w.spend_usd,
            total_in,
            w.tokens - total_in,
            w.requests,
            w.reserved_usd,
        )
    ]
    for deployment, d in sorted(per.items()):
        rows.append(
            UsageRow(
                tenant,
                window,
                bucket_id,
                deployment,
                d.get("usd", 0) / NANO,
                d.get("in", 0),
                d.get("out", 0),
                d.get("req", 0),
            )
        )
    return rows


class Store(Protocol):
    async def reserve(self, hold: Hold) -> Reservation | Refusal: ...
    async def settle(self, reservation: Reservation, spend: Spend) -> bool: ...
    async def release(self, reservation: Reservation) -> bool: ...
    async def observe(
        self, tenant: str, session_id: str | None, rate_window_s: float = 30.0, idle_ttl_s: int = 3600
    ) -> Observation: ...
    async def snapshot(self, tenant: str) -> TenantSnapshot: ...
    async def step(
        self, tenant: str, session_id: str, rate_window_s: float, idle_ttl_s: int
    ) -> SessionState: ...
    async def usage(self, tenant: str | None = None) -> list[UsageRow]: ...
    async def put_key(self, record: KeyRecord) -> None: ...
    async def find_key(self, digest: str) -> KeyRecord | None: ...
    async def list_keys(self) -> list[KeyRecord]: ...
    async def delete_key(self, key_id: str) -> KeyRecord | None: ...
    async def ping(self) -> None: ...
    async def close(self) -> None: ...
