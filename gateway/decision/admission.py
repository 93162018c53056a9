"""The pure admission verdict: a tenant's budget windows and session state against each deployment's worst case.

`admission(snapshot, tenant, costs, ...)` turns a store snapshot plus each candidate deployment's
worst-case `Cost` into an `Admission`: the deployments this request may use, the one to prefer, and,
when none is allowed, the limit that refused it and a retry-after. The store's reserve re-checks the
hard limits atomically, so a stale snapshot can only cost a 429 at reserve time, never an overspend.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from gateway.errors import BadRequest
from gateway.features import Features, prompt_tokens_with_template
from gateway.policy.model import Deployment, Policy
from gateway.policy.tenancy import SessionPolicy, TenantPolicy, Window, find_tenant

ANONYMOUS = "anonymous"  # the tenant of every request while auth is off
MAX_COST_HEADER = "x-gateway-max-cost-usd"


def window_bucket(window: Window, now_s: float) -> tuple[str, float]:
    """The bucket id of `window` at `now_s` and the time it ends (both UTC)."""
    return _window_bucket(window, math.floor(now_s / 60))


@functools.lru_cache(maxsize=64)
def _window_bucket(window: Window, minute: int) -> tuple[str, float]:
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
    session_prefers: bool = False  # `prefer` is the session's (pin, tight loop), not a budget's

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
    session_prefers: bool = False


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
    return Admission(frozenset(v.allowed), v.prefer, v.limit, v.retry_after_s, tuple(v.reasons), v.session_prefers)


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
        v.prefer, v.session_prefers = sessions.tight_loop_route_to, True
        v.reasons.append(f"tight loop: {session.steps_per_min:.1f} steps/min > {loop:g}")
    elif sessions.pin and session.pinned is not None and session.pinned in v.allowed:
        v.prefer, v.session_prefers = session.pinned, True
        v.reasons.append(f"session pinned to {session.pinned}")


def needs_admission(policy: Policy, headers: Mapping[str, str]) -> bool:
    """Whether this request needs admission at all: tenancy is configured, or it caps its own cost."""
    return policy.accounted or MAX_COST_HEADER in headers


def completion_cap(deployment: Deployment, prompt_tokens: int, max_tokens: int | None) -> int:
    """The tokens one choice may generate: max_tokens, else the deployment's default_max_tokens (which the
    gateway then sends as the cap), within the deployment's context window."""
    completion = max_tokens if max_tokens is not None else deployment.default_max_tokens
    if deployment.max_model_len is not None:
        # the deployment cannot generate past its context window, whatever max_tokens says
        completion = max(0, min(completion, deployment.max_model_len - prompt_tokens))
    return completion


def worst_case(deployment: Deployment, prompt_tokens: int, max_tokens: int | None, choices: int = 1) -> Cost:
    """Prompt tokens at the input price plus each choice's completion cap at the output price."""
    completion = completion_cap(deployment, prompt_tokens, max_tokens) * choices
    return Cost(deployment.price.cost_usd(prompt_tokens, completion), prompt_tokens + completion)


def judge(
    policy: Policy,
    costs: Mapping[str, Cost],
    headers: Mapping[str, str],
    snapshot: TenantSnapshot,
    session: SessionState | None = None,
) -> Admission:
    """The verdict for a tenant in `snapshot` (pure: `policy explain` calls it with assumed figures)."""
    limits = find_tenant(policy.tenants, snapshot.tenant)
    cap = _max_cost(headers)
    return admission(snapshot, limits, costs, session=session, sessions=policy.sessions, max_cost_usd=cap)


def tracks_sessions(rules: SessionPolicy) -> bool:
    return rules.pin or rules.tight_loop_steps_per_min is not None or rules.cost_cap_usd is not None


def has_soft_limits(limits: TenantPolicy | None) -> bool:
    if limits is None:
        return False
    return any(b.soft_usd is not None or b.soft_tokens is not None for b in limits.budgets)


def costs_of(policy: Policy, features: Features, body_bytes: int, choices: int = 1) -> dict[str, Cost]:
    """Each deployment's worst case for this request: an upper bound on its prompt, every choice's cap out."""
    prompt = _prompt_bound(features, body_bytes)
    return {
        name: worst_case(dep, prompt, features.max_tokens, choices) for name, dep in policy.deployments.items()
    }


def caps_of(policy: Policy, features: Features, body_bytes: int) -> dict[str, int]:
    """The completion cap to send each deployment when the request sets none: the one its worst case assumed,
    so the hold stays an upper bound (empty when the request caps itself, or generates nothing)."""
    if features.max_tokens is not None or features.endpoint == "embeddings":
        return {}
    prompt = _prompt_bound(features, body_bytes)
    caps = {name: completion_cap(dep, prompt, None) for name, dep in policy.deployments.items()}
    return {name: cap for name, cap in caps.items() if cap >= 1}


def _prompt_bound(features: Features, body_bytes: int) -> int:
    # an estimate is not a bound; no tokenizer makes more tokens than bytes
    return prompt_tokens_with_template(features) if features.prompt_tokens_exact else body_bytes


def _max_cost(headers: Mapping[str, str]) -> float | None:
    raw = headers.get(MAX_COST_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise BadRequest(
            f"{MAX_COST_HEADER} must be a non-negative number of USD, got {raw[:32]!r}",
            param=MAX_COST_HEADER,
            code="invalid_header",
        )
    return value
