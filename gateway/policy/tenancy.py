"""Tenant, session, store and auth policy sections, budget windows and the pure admission verdict.

Contract for the core (pure: no redis, aiohttp or I/O here):

- Policy fields (add to `policy.Policy`): `tenants: list[TenantPolicy] = []`,
  `sessions: SessionPolicy = SessionPolicy()`, `store: StorePolicy = StorePolicy()`,
  `auth: AuthPolicy = AuthPolicy()`. Deployment names inside these sections (`above_soft.route_to`,
  `above_soft.refuse`, `sessions.tight_loop_route_to`) should be checked by Policy's reference check.
- `find_tenant(tenants, name)` picks a tenant's limits (exact name, else the `"*"` template, else None).
- `admission(snapshot, tenant, costs, ...)` turns a store snapshot plus each candidate deployment's
  worst-case `Cost` into an `Admission`: the deployments this request may use, the one to prefer, and,
  when none is allowed, the limit that refused it and a retry-after. The store's reserve re-checks the
  hard limits atomically, so a stale snapshot can only cost a 429 at reserve time, never an overspend.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

NAME_PATTERN = r"^[A-Za-z0-9_.*-]{1,64}$"


class Window(StrEnum):
    """A time-bucketed accounting window; buckets are aligned to UTC."""

    MINUTE = "minute"  # the current clock minute
    HOUR = "hour"  # the current clock hour
    DAY = "day"  # the current UTC day
    MONTH = "month"  # the current UTC calendar month


WINDOWS: tuple[Window, ...] = tuple(Window)


class Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Budget(Frozen):
    """Spend limits over one window; soft steers routing, hard refuses with 429."""

    window: Window
    soft_usd: float | None = Field(None, ge=0)
    hard_usd: float | None = Field(None, ge=0)
    soft_tokens: int | None = Field(None, ge=0)
    hard_tokens: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _soft_below_hard(self) -> Budget:
        for soft, hard, unit in (
            (self.soft_usd, self.hard_usd, "usd"),
            (self.soft_tokens, self.hard_tokens, "tokens"),
        ):
            if soft is not None and hard is not None and soft > hard:
                raise ValueError(f"soft_{unit} {soft} is above hard_{unit} {hard}")
        return self


class AboveSoft(Frozen):
    """What a soft limit does: steer to a cheaper deployment, and/or refuse some deployments (429)."""

    route_to: str | None = "fast"
    refuse: tuple[str, ...] = ()


class TenantPolicy(Frozen):
    name: str = Field(pattern=NAME_PATTERN)  # "*" is the template for tenants not listed
    budgets: tuple[Budget, ...] = ()
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    max_concurrent: int | None = Field(None, ge=1)
    above_soft: AboveSoft = AboveSoft()

    @model_validator(mode="after")
    def _one_budget_per_window(self) -> TenantPolicy:
        windows = [b.window for b in self.budgets]
        if len(windows) != len(set(windows)):
            raise ValueError(f"budgets: one entry per window, got {[str(w) for w in windows]}")
        return self

    def budget(self, window: Window) -> Budget | None:
        return next((b for b in self.budgets if b.window == window), None)


class SessionPolicy(Frozen):
    pin: bool = False  # keep a session on the deployment its first admitted step used
    tight_loop_steps_per_min: float | None = Field(None, gt=0)  # above this step rate, prefer…
    tight_loop_route_to: str = "fast"  # …this deployment
    rate_window_s: float = Field(30.0, gt=0, le=600)  # the step rate is measured over this window
    cost_cap_usd: float | None = Field(None, ge=0)  # a session that spent this much is refused
    idle_ttl_s: int = Field(3600, ge=60)  # a session unseen this long is forgotten


class StorePolicy(Frozen):
    redis_url: str | None = None  # None: the embedded in-memory store (a single replica)
    on_unavailable: Literal["allow", "reject"] = "allow"
    timeout_s: float = Field(0.25, gt=0, le=10)  # per Redis command, connect included
    retry_s: float = Field(1.0, gt=0)  # while Redis is down, probe it again this often
    reservation_ttl_s: float = Field(900.0, gt=0)  # a crashed replica's reservations expire after this


class AuthPolicy(Frozen):
    enabled: bool = False
    admin_token_env: str = "AGENT_GATEWAY_ADMIN_TOKEN"  # the env var holding the admin token


def find_tenant(tenants: Sequence[TenantPolicy], name: str) -> TenantPolicy | None:
    """The tenant's own section, else the "*" template, else None (no limits)."""
    template = None
    for tenant in tenants:
        if tenant.name == name:
            return tenant
        if tenant.name == "*":
            template = tenant
    return template


def bucket(window: Window, now_s: float) -> tuple[str, float]:
    """The bucket id of `window` at `now_s` and the time it ends (both UTC)."""
    return _bucket(window, math.floor(now_s / 60))


@functools.lru_cache(maxsize=64)
def _bucket(window: Window, minute: int) -> tuple[str, float]:
    # every window is a whole number of minutes, so the minute index determines the bucket (and caches)
    now_s = minute * 60
    if window is Window.MONTH:
        t = datetime.fromtimestamp(now_s, UTC)
        nxt = datetime(t.year + (t.month == 12), t.month % 12 + 1, 1, tzinfo=UTC)
        return f"{t.year:04d}{t.month:02d}", nxt.timestamp()
    size_s = {Window.MINUTE: 60, Window.HOUR: 3600, Window.DAY: 86400}[window]
    index = math.floor(now_s / size_s)
    return f"{index}", float((index + 1) * size_s)


@dataclass(frozen=True, slots=True)
class Cost:
    """A request's (worst-case or actual) cost."""

    usd: float
    tokens: int


@dataclass(frozen=True, slots=True)
class WindowUsage:
    """One window's current bucket: settled spend plus what open reservations hold."""

    window: Window
    spend_usd: float = 0.0
    reserved_usd: float = 0.0
    tokens: int = 0
    reserved_tokens: int = 0
    requests: int = 0
    ends_at_s: float = 0.0

    @property
    def committed_usd(self) -> float:
        return self.spend_usd + self.reserved_usd

    @property
    def committed_tokens(self) -> int:
        return self.tokens + self.reserved_tokens


@dataclass(frozen=True, slots=True)
class TenantSnapshot:
    tenant: str
    now_s: float
    windows: Mapping[Window, WindowUsage]
    concurrent: int = 0


@dataclass(frozen=True, slots=True)
class SessionState:
    session_id: str
    steps: int = 0
    steps_per_min: float = 0.0
    cost_usd: float = 0.0
    pinned: str | None = None


@dataclass(frozen=True, slots=True)
class Admission:
    """The budget and session verdict for one request."""

    allowed: frozenset[str]  # deployments the request may use; empty: refuse with 429
    prefer: str | None = None  # use this deployment when it is allowed
    limit: str | None = None  # the limit that bound: "usd_per_day", "requests_per_minute", "session_usd" …
    retry_after_s: float = 0.0  # meaningful when nothing is allowed
    reasons: tuple[str, ...] = ()

    @property
    def refused(self) -> bool:
        return not self.allowed


@dataclass(slots=True)
class _Verdict:
    allowed: dict[str, Cost]
    prefer: str | None = None
    limit: str | None = None
    retry_after_s: float = 0.0
    reasons: list[str] = field(default_factory=list)


def admission(
    snapshot: TenantSnapshot,
    tenant: TenantPolicy | None,
    costs: Mapping[str, Cost],
    *,
    session: SessionState | None = None,
    sessions: SessionPolicy | None = None,
    max_cost_usd: float | None = None,
) -> Admission:
    """Which of the candidate deployments (worst-case `costs`) this request may use, and which to prefer.

    Precedence: hard limits and the session cost cap refuse; the `x-gateway-max-cost-usd` cap drops
    deployments (keeping the cheapest); a soft limit steers (`above_soft`); then a tight agent loop
    prefers `tight_loop_route_to`; then a pinned session prefers its first deployment.
    """
    v = _Verdict(allowed=dict(costs))
    if tenant is not None:
        _apply_hard(v, snapshot, tenant)
    if session is not None and sessions is not None:
        _apply_session_cap(v, session, sessions)
    if max_cost_usd is not None and v.allowed:
        _apply_cost_header(v, max_cost_usd)
    if tenant is not None and v.allowed:
        _apply_soft(v, snapshot, tenant)
    if session is not None and sessions is not None and v.allowed and v.prefer is None:
        _apply_session_preference(v, session, sessions)
    return Admission(frozenset(v.allowed), v.prefer, v.limit, v.retry_after_s, tuple(v.reasons))


def _hard_limits(tenant: TenantPolicy) -> list[tuple[Window, str, float]]:
    """(window, limit name, hard limit) for every hard limit of the tenant, tokens_per_minute included."""
    out: list[tuple[Window, str, float]] = []
    for b in tenant.budgets:
        if b.hard_usd is not None:
            out.append((b.window, f"usd_per_{b.window}", b.hard_usd))
        if b.hard_tokens is not None:
            out.append((b.window, f"tokens_per_{b.window}", b.hard_tokens))
    if tenant.tokens_per_minute is not None:
        out.append((Window.MINUTE, "tokens_per_minute", tenant.tokens_per_minute))
    return out


def _apply_hard(v: _Verdict, snapshot: TenantSnapshot, tenant: TenantPolicy) -> None:
    minute = snapshot.windows.get(Window.MINUTE, WindowUsage(Window.MINUTE))
    if tenant.max_concurrent is not None and snapshot.concurrent >= tenant.max_concurrent:
        _refuse_all(
            v, "concurrent", 1.0, f"{snapshot.concurrent} requests in flight >= {tenant.max_concurrent}"
        )
        return
    if tenant.requests_per_minute is not None and minute.requests >= tenant.requests_per_minute:
        retry = minute.ends_at_s - snapshot.now_s
        _refuse_all(v, "requests_per_minute", retry, f"{minute.requests} requests this minute")
        return
    for window, name, limit in _hard_limits(tenant):
        usage = snapshot.windows.get(window, WindowUsage(window))
        for deployment, cost in list(v.allowed.items()):
            used, extra = (
                (usage.committed_usd, cost.usd)
                if name.startswith("usd")
                else (usage.committed_tokens, cost.tokens)
            )
            if used + extra > limit:
                del v.allowed[deployment]
                v.reasons.append(f"{deployment}: {name} {used:g} + {extra:g} > hard {limit:g}")
                if not v.allowed:
                    v.limit, v.retry_after_s = name, max(0.0, usage.ends_at_s - snapshot.now_s)


def _refuse_all(v: _Verdict, limit: str, retry_after_s: float, why: str) -> None:
    v.allowed.clear()
    v.limit, v.retry_after_s = limit, max(0.0, retry_after_s)
    v.reasons.append(f"refused: {limit}: {why}")


def _apply_session_cap(v: _Verdict, session: SessionState, sessions: SessionPolicy) -> None:
    cap = sessions.cost_cap_usd
    if cap is not None and session.cost_usd >= cap:
        _refuse_all(
            v, "session_usd", float(sessions.idle_ttl_s), f"session spent {session.cost_usd:g} >= {cap:g}"
        )


def _apply_cost_header(v: _Verdict, max_cost_usd: float) -> None:
    cheapest = min(v.allowed, key=lambda d: v.allowed[d].usd)
    for deployment, cost in list(v.allowed.items()):
        if cost.usd > max_cost_usd and deployment != cheapest:
            del v.allowed[deployment]
            v.reasons.append(
                f"{deployment}: worst case {cost.usd:g} USD > x-gateway-max-cost-usd {max_cost_usd:g}"
            )
    if v.allowed[cheapest].usd > max_cost_usd:
        v.reasons.append(f"{cheapest}: kept although over x-gateway-max-cost-usd: it is the cheapest")


def _apply_soft(v: _Verdict, snapshot: TenantSnapshot, tenant: TenantPolicy) -> None:
    crossed = _soft_crossed(snapshot, tenant)
    if crossed is None:
        return
    v.limit = crossed
    v.reasons.append(f"soft limit {crossed} crossed")
    for deployment in tenant.above_soft.refuse:
        if deployment in v.allowed and len(v.allowed) > 0:
            del v.allowed[deployment]
            v.reasons.append(f"{deployment}: refused above soft {crossed}")
            if not v.allowed:
                window = Window(crossed.rsplit("_", 1)[1])
                usage = snapshot.windows.get(window, WindowUsage(window))
                v.retry_after_s = max(0.0, usage.ends_at_s - snapshot.now_s)
    target = tenant.above_soft.route_to
    if target is not None and target in v.allowed:
        v.prefer = target


def _soft_crossed(snapshot: TenantSnapshot, tenant: TenantPolicy) -> str | None:
    for b in tenant.budgets:
        usage = snapshot.windows.get(b.window, WindowUsage(b.window))
        if b.soft_usd is not None and usage.committed_usd >= b.soft_usd:
            return f"usd_per_{b.window}"
        if b.soft_tokens is not None and usage.committed_tokens >= b.soft_tokens:
            return f"tokens_per_{b.window}"
    return None


def _apply_session_preference(v: _Verdict, session: SessionState, sessions: SessionPolicy) -> None:
    loop = sessions.tight_loop_steps_per_min
    if loop is not None and session.steps_per_min > loop and sessions.tight_loop_route_to in v.allowed:
        v.prefer = sessions.tight_loop_route_to
        v.reasons.append(f"tight loop: {session.steps_per_min:.1f} steps/min > {loop:g}")
    elif sessions.pin and session.pinned is not None and session.pinned in v.allowed:
        v.prefer = session.pinned
        v.reasons.append(f"session pinned to {session.pinned}")
