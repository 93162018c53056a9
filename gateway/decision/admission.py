"""The pure admission verdict: a tenant's budget windows and session state against each deployment's worst case.

`admission(snapshot, tenant, costs, ...)` turns a store snapshot plus each candidate deployment's
worst-case `Cost` into an `Admission`: the deployments this request may use, the one to prefer, and,
when none is allowed, the limit that refused it and a retry-after. The store's reserve re-checks the
hard limits atomically, so a stale snapshot can only cost a 429 at reserve time, never an overspend.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from gateway.errors import BadRequest, ContextTooLong
from gateway.features import Features, prompt_floor, prompt_tokens_with_template
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


# A context window that leaves fewer tokens than this (and fewer than the request asks for) cannot answer
# it usefully: the deployment is refused for it, rather than sent a cap that cuts the answer off.
MIN_USEFUL_COMPLETION_TOKENS = 16


@dataclass(frozen=True, slots=True)
class PromptSize:
    """A prompt's size in tokens as the gateway knows it before the call: a bound each way.

    Billing holds the ceiling; the room left in a context window is sized by the floor, never by the
    ceiling (a byte count is ~4x the tokens of English text: room sized by it cuts answers short).
    """

    ceiling: int  # at most this: the count plus chat-template wrapping, else the body's bytes
    floor: int  # at least this: the count, else what was counted of it (0 when nothing was)
    counted: bool = True  # the whole prompt was counted (floor is its count); else the ceiling is its bytes


def prompt_size(features: Features, body_bytes: int, counted: tuple[int, bool] | None = None) -> PromptSize:
    """The prompt's bounds from its features, or from `counted` (features.prompt_floor's answer) when given."""
    wrapping = prompt_tokens_with_template(features) - features.prompt_tokens
    if features.prompt_tokens_exact:
        return PromptSize(features.prompt_tokens + wrapping, features.prompt_tokens)
    if counted is not None and counted[1]:
        return PromptSize(counted[0] + wrapping, counted[0])
    # no tokenizer makes more tokens than bytes
    return PromptSize(body_bytes, counted[0] if counted is not None else 0, counted=False)


def completion_cap(deployment: Deployment, prompt: PromptSize, max_tokens: int | None) -> int:
    """The tokens one choice may generate, which the hold assumes and the gateway sends: max_tokens, else the
    deployment's default_max_tokens, within what its context window leaves after the prompt's floor (the
    deployment stops there itself, so this clamp never cuts an answer the deployment would have given)."""
    completion = max_tokens if max_tokens is not None else deployment.default_max_tokens
    if deployment.max_model_len is not None:
        completion = max(0, min(completion, deployment.max_model_len - prompt.floor))
    return completion


def room_depends_on_count(policy: Policy, features: Features, prompt: PromptSize) -> bool:
    """Whether an exact count could change a cap or the ceiling enough to matter: a context window the
    prompt's ceiling plus its cap would overflow (so the room, not the cap, may bind)."""
    return not prompt.counted and any(
        dep.max_model_len is not None and completion_cap(dep, prompt, features.max_tokens) + prompt.ceiling
        > dep.max_model_len
        for dep in policy.deployments.values()
    )


# A prompt whose room depends on its count is counted over at most this many characters, which bounds the
# time one count takes (docs/performance.md, 'Why the code is shaped so'); past them, the floor is what was counted.
ROOM_COUNT_MAX_CHARS = 1_000_000


def measure_prompt(policy: Policy, features: Features, body: Mapping[str, Any], body_bytes: int) -> PromptSize:
    """The prompt's bounds, counted exactly (bounded) when a context window's room depends on the count:
    the bytes that bound its billing would size that room ~4x too small. When it counts, its cost grows with the
    tokens: the live gateway runs it in a worker thread then (accounting.ledger); offline tools inline."""
    size = prompt_size(features, body_bytes)
    if not room_depends_on_count(policy, features, size):
        return size
    widest = max(dep.max_model_len or 0 for dep in policy.deployments.values())
    return prompt_size(features, body_bytes, prompt_floor(body, features.endpoint, ROOM_COUNT_MAX_CHARS, widest))


def worst_case(deployment: Deployment, prompt: PromptSize | int, max_tokens: int | None, choices: int = 1) -> Cost:
    """The prompt's ceiling at the input price plus each choice's completion cap at the output price (an int
    prompt is an exact count: its own floor and ceiling). None of the prompt is assumed cached: nothing here
    knows which deployment holds which prefix, and a switch or a failover prefills it all again; the settle
    charges the cached tokens the deployment reports at their price."""
    size = prompt if isinstance(prompt, PromptSize) else PromptSize(prompt, prompt)
    out = completion_cap(deployment, size, max_tokens) * choices
    return Cost(deployment.price.cost_usd(size.ceiling, out, cached_tokens=0), size.ceiling + out)


@dataclass(frozen=True, slots=True)
class OutputPlan:
    """Each deployment's output cap for one request: the tokens per choice its hold assumes and the gateway
    sends (a generating request always goes with a finite cap when budgets apply)."""

    caps: Mapping[str, int]
    roomless: Mapping[str, str]  # deployments whose context window leaves no useful room, and why


def output_plan(policy: Policy, features: Features, prompt: PromptSize) -> OutputPlan:
    """The cap each deployment gets; those whose window leaves less than is useful are named, not capped."""
    if features.endpoint == "embeddings":
        return OutputPlan({}, {})
    caps: dict[str, int] = {}
    roomless: dict[str, str] = {}
    for name, dep in policy.deployments.items():
        wanted = features.max_tokens if features.max_tokens is not None else dep.default_max_tokens
        cap = completion_cap(dep, prompt, features.max_tokens)
        if cap < min(wanted, MIN_USEFUL_COMPLETION_TOKENS):
            roomless[name] = (f"{name}: a prompt of at least {prompt.floor} tokens leaves {cap} of its "
                              f"max_model_len {dep.max_model_len} for the answer ({wanted} wanted)")
        caps[name] = cap
    return OutputPlan(caps, roomless)


def fit_room(verdict: Admission, plan: OutputPlan, policy: Policy, features: Features) -> Admission:
    """The verdict without the deployments whose window leaves no useful room; 400 context_length_exceeded
    when none of the deployments serving the endpoint has room, or none the budget admits has."""
    if not plan.roomless or verdict.refused:
        return verdict
    roomless = plan.roomless.keys()
    kept = verdict.allowed - roomless
    serving = {n for n, dep in policy.deployments.items() if features.endpoint in dep.endpoints}
    if not kept or (serving and serving <= roomless):
        why = "; ".join(plan.roomless[n] for n in sorted(roomless & serving or roomless))
        others = "" if serving <= roomless else "; the deployments with room are not admitted by the budget"
        raise ContextTooLong(f"The request does not fit a context window: {why}{others}. Shorten the prompt "
                             "or lower max_tokens", param="messages" if features.endpoint == "chat" else "prompt")
    dropped = tuple(f"{plan.roomless[n]}: skipped" for n in sorted(verdict.allowed & roomless))
    keeps_preference = verdict.prefer in kept
    return dataclasses.replace(
        verdict, allowed=kept, reasons=(*verdict.reasons, *dropped), prefer=verdict.prefer if keeps_preference
        else None, session_prefers=verdict.session_prefers and keeps_preference,
    )


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


def costs_of(
    policy: Policy, features: Features, body_bytes: int, choices: int = 1, *, prompt: PromptSize | None = None
) -> dict[str, Cost]:
    """Each deployment's worst case for this request: the prompt's ceiling, every choice's cap out (the caps
    output_plan sends)."""
    size = prompt if prompt is not None else prompt_size(features, body_bytes)
    cap = features.max_tokens if features.endpoint != "embeddings" else 0
    return {name: worst_case(dep, size, cap, choices) for name, dep in policy.deployments.items()}


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
