"""Whether a warm-up may go now, and how each one ends (pure): a warm-up never stands in a live call's way.

    why_not = admit(warm, uncached_tokens, load, warming)      None: send it; else the Outcome that skips it

A warm-up is the session's prompt sent with `max_tokens: 1` to the deployment its next step is expected on
(decision/switch.expected_next), after the step's answer is relayed: that deployment prefills the prompt while
the agent's tool runs, so the move, when it comes, finds it cached. It goes only to a healthy deployment with
nothing waiting and room in its KV cache, never beyond `max_in_flight` at once (one more is dropped: a queued
warm-up would be stale by the time it ran), and never for more than `max_prefill_tokens`.
"""

from __future__ import annotations

from enum import StrEnum

from gateway.decision.routing import DeploymentLoad
from gateway.policy.switch import WarmPolicy


class Outcome(StrEnum):
    """How a warm-up ended (the `outcome` label of gateway_cache_warmups_total)."""

    DONE = "done"  # the deployment prefilled the prompt; the session's record holds its chain there
    FAILED = "failed"  # the deployment answered an error, or the connection failed
    TIMEOUT = "timeout"  # no answer within warm.timeout_s
    CANCELLED = "cancelled"  # the session's next step arrived first: stale
    SUPERSEDED = "superseded"  # a newer warm-up of the same session replaced it: stale
    BUSY = "busy"  # skipped: the deployment had requests waiting or a full KV cache (live calls first)
    FULL = "full"  # skipped: max_in_flight warm-ups already on the deployment (dropped, not queued)
    TOO_LONG = "too_long"  # skipped: more to prefill than max_prefill_tokens
    CACHED = "cached"  # skipped: the deployment already holds the whole prompt
    UNHEALTHY = "unhealthy"  # skipped: the deployment is ejected or unknown
    BUDGET = "budget"  # skipped: the tenant's budget (or its session's) has no room for the warm-up's cost


def admit(warm: WarmPolicy, uncached_tokens: int, load: DeploymentLoad | None, warming: int) -> Outcome | None:
    """None when the warm-up may go now; else the reason it is skipped."""
    if uncached_tokens <= 0:
        return Outcome.CACHED
    if uncached_tokens > warm.max_prefill_tokens:
        return Outcome.TOO_LONG
    if load is None or not load.healthy:
        return Outcome.UNHEALTHY
    if load.requests_waiting > warm.max_waiting or load.kv_cache_usage > warm.max_kv_cache_usage:
        return Outcome.BUSY
    if warming >= warm.max_in_flight:
        return Outcome.FULL
    return None
