"""The policy's `agents` section: trajectory recording bounds, dead-loop and cost-spike detection, per-tenant overrides.

`AgentsPolicy.for_tenant(name)` resolves a tenant's effective `loops` and `spikes` (its override merged over
the section's own values: exact name, else `"*"`, else the section as written). Deployment names
(`loops.escalate_to`, `spikes.steer_to`) are checked by Policy's reference check.
"""

from __future__ import annotations

import functools
import re
from typing import Literal, TypeVar

from pydantic import Field, field_validator, model_validator

from gateway.frozen import Frozen
from gateway.policy.tenancy import NAME_PATTERN

T = TypeVar("T", bound=Frozen)
LoopAction = Literal["flag", "escalate", "stop"]
SpikeAction = Literal["flag", "steer", "stop"]


class Recording(Frozen):
    """What the trajectory record keeps: steps per session, sessions in all, for how long."""

    enabled: bool = True
    max_steps_per_session: int = Field(200, ge=1, le=10_000)  # older steps are dropped first
    max_sessions: int = Field(10_000, ge=1, le=1_000_000)  # the least recently active session goes first
    ttl_s: int = Field(86_400, ge=60)  # a session idle this long is forgotten


class Repeats(Frozen):
    """`count` occurrences of the same thing within the session's last `window_steps` steps."""

    count: int = Field(ge=2)
    window_steps: int = Field(ge=2, le=200)

    @model_validator(mode="after")
    def _window_holds_count(self) -> Repeats:
        if self.window_steps < self.count:
            raise ValueError(f"window_steps {self.window_steps} is smaller than count {self.count}: "
                             "the loop could never show")
        return self


class LoopPolicy(Frozen):
    """Dead loops: the same tool call, the same tool error, the same assistant output, too many steps."""

    action: LoopAction = "flag"  # flag: metric, log, span event, shown in `sessions`; escalate: next steps to
    escalate_to: str = "hq"  # this deployment; stop: 429 `agent_loop_detected` naming the loop
    repeated_tool_call: Repeats | None = Repeats(count=5, window_steps=10)  # same tool name + argument digest
    repeated_tool_error: Repeats | None = Repeats(count=3, window_steps=10)  # same error fed back
    repeated_output: Repeats | None = Repeats(count=4, window_steps=8)  # same assistant message sent back
    max_steps: int | None = Field(None, ge=1)  # a session with more steps than this is flagged


class SpikePolicy(Frozen):
    """Cost spikes: spend per minute over the last `window_s` against the median of the windows before."""

    action: SpikeAction = "flag"  # flag; steer: next steps to `steer_to`; stop: 429 `agent_cost_spike`
    steer_to: str = "fast"
    factor: float = Field(5.0, gt=1)  # flagged above factor x baseline…
    floor_usd_per_min: float = Field(0.5, ge=0)  # …and above this absolute rate
    window_s: float = Field(60.0, ge=10, le=3600)  # whole 10 s buckets
    history_windows: int = Field(30, ge=2, le=1000)  # how many earlier windows the baseline looks at
    min_windows: int = Field(5, ge=1)  # fewer earlier windows than this: no baseline yet, nothing flagged
    scopes: tuple[Literal["session", "tenant"], ...] = ("session", "tenant")


class TenantAgents(Frozen):
    """A tenant's override: only the fields given replace the section's own."""

    loops: LoopPolicy | None = None
    spikes: SpikePolicy | None = None


class AgentsPolicy(Frozen):
    record: Recording = Recording()
    loops: LoopPolicy = LoopPolicy()
    spikes: SpikePolicy = SpikePolicy()
    tenants: dict[str, TenantAgents] = {}

    @field_validator("tenants")
    @classmethod
    def _tenant_names(cls, tenants: dict[str, TenantAgents]) -> dict[str, TenantAgents]:
        for name in tenants:
            if not re.match(NAME_PATTERN, name):
                raise ValueError(f"tenant name {name!r} must match {NAME_PATTERN}")
        return tenants

    def for_tenant(self, tenant: str) -> tuple[LoopPolicy, SpikePolicy]:
        """The tenant's effective loop and spike rules (cached: policies are swapped whole on reload)."""
        found = self._resolved.get(tenant)
        if found is None:
            override = self.tenants.get(tenant) or self.tenants.get("*")
            found = (self.loops, self.spikes) if override is None else (
                _merged(self.loops, override.loops), _merged(self.spikes, override.spikes))
            if len(self._resolved) < 4096:  # tenant names come from keys: bounded, but stay safe
                self._resolved[tenant] = found
        return found

    @functools.cached_property
    def _resolved(self) -> dict[str, tuple[LoopPolicy, SpikePolicy]]:
        return {}

    @functools.cached_property
    def enforcing(self) -> bool:
        """Whether any tenant's rules act beyond flagging (the request path then reads the session's flags)."""
        sections = [(self.loops, self.spikes), *(self.for_tenant(name) for name in self.tenants)]
        return any(loops.action != "flag" or spikes.action != "flag" for loops, spikes in sections)

    def targets(self) -> list[tuple[str, str]]:
        """(field, deployment) of every deployment an acting rule routes to, for the reference check."""
        out = []
        for where, (loops, spikes) in [("agents", (self.loops, self.spikes)),
                                       *((f"agents.tenants.{n}", self.for_tenant(n)) for n in self.tenants)]:
            if loops.action == "escalate":
                out.append((f"{where}.loops.escalate_to", loops.escalate_to))
            if spikes.action == "steer":
                out.append((f"{where}.spikes.steer_to", spikes.steer_to))
        return out


def _merged(base: T, override: T | None) -> T:
    if override is None:
        return base
    return type(base).model_validate({**base.model_dump(), **override.model_dump(exclude_unset=True)})
