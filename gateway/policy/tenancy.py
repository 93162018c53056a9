"""The policy's tenant, session, store and auth sections, and the budget windows they name.

Deployment names inside these sections (`above_soft.route_to`, `above_soft.refuse`,
`sessions.tight_loop_route_to`) are checked by Policy's reference check. `find_tenant(tenants, name)`
picks a tenant's limits (exact name, else the `"*"` template, else None).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Literal

from pydantic import Field, model_validator

from gateway.frozen import Frozen
from gateway.policy.context import ContextPolicy, ObjectStorePolicy

NAME_PATTERN = r"^[A-Za-z0-9_.*-]{1,64}$"


class Window(StrEnum):
    """A time-bucketed accounting window; buckets are aligned to UTC."""

    MINUTE = "minute"  # the current clock minute
    HOUR = "hour"  # the current clock hour
    DAY = "day"  # the current UTC day
    MONTH = "month"  # the current UTC calendar month


WINDOWS: tuple[Window, ...] = tuple(Window)



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
    context: ContextPolicy | None = None  # this tenant's own context rules; default: its route's, the policy's

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


class StoredResponsesPolicy(Frozen):
    """How long and how many Responses API answers the gateway keeps for clients to chain onto
    (`previous_response_id`), in the store (Redis, else memory); over a count the oldest go first. Read at each
    answer kept: a reload applies to the answers kept after it."""

    ttl_s: int = Field(24 * 3600, ge=60, le=366 * 24 * 3600)
    max_per_tenant: int = Field(10_000, ge=1)
    max_total: int = Field(100_000, ge=1)


class StorePolicy(Frozen):
    redis_url: str | None = None  # None: the embedded in-memory store (a single replica)
    on_unavailable: Literal["allow", "reject"] = "allow"
    timeout_s: float = Field(0.25, gt=0, le=10)  # per Redis command, connect included
    max_connections: int = Field(32, ge=1, le=10_000)  # per process; more commands wait for one…
    pool_timeout_s: float = Field(5.0, gt=0, le=60)  # …this long at most (503 store_busy, not an outage)
    memory_max_keys: int = Field(200_000, ge=1000)  # the in-memory store's bound; idle sessions go first
    retry_s: float = Field(1.0, gt=0)  # while Redis is down, probe it again this often
    reservation_ttl_s: float = Field(900.0, gt=0)  # a crashed replica's reservations expire after this
    objects: ObjectStorePolicy = ObjectStorePolicy()  # where masked tool outputs are kept
    responses: StoredResponsesPolicy = StoredResponsesPolicy()  # the Responses API's answers kept for chains


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


