"""The explanation trail of one decision, as the admin API and `policy explain` show it (pure)."""

from __future__ import annotations

from typing import Any

from gateway.agents.session_ids import shown_id
from gateway.context.anthropic_edits import Managed
from gateway.context.masking import MASK, Masking
from gateway.decision.routing import Context, Decision
from gateway.features import Features


def explanation(decision: Decision, features: Features, ctx: Context,
                context: Managed | None = None, masking: Masking | None = None) -> dict[str, Any]:
    """The decision trail as JSON: what was chosen, why, every input the decision read, and the context edits
    that made the prompt it read (under `context`, when the API asked for any, and the policy's masking of old
    tool outputs under `context.mask_tool_outputs`)."""
    report: dict[str, Any] = {
        "deployment": decision.deployment,
        "rule": decision.rule,
        "attempts": list(decision.attempts),
        "reasons": list(decision.reasons),
        "complexity": ctx.complexity,
        "share_thresholds": {f"{share:g}": threshold for share, threshold in ctx.share_thresholds.items()},
        "admission": None if ctx.admission is None else {
            "allowed": sorted(ctx.admission.allowed), "prefer": ctx.admission.prefer,
            "limit": ctx.admission.limit, "reasons": list(ctx.admission.reasons)},
        "session": None if ctx.session is None else {
            "id": shown_id(ctx.session.session_id), "steps": ctx.session.steps,
            "steps_per_min": ctx.session.steps_per_min, "cost_usd": ctx.session.cost_usd,
            "pinned": ctx.session.pinned},
        "features": features.as_record(),
        "load": {name: {"healthy": load.healthy, "requests_waiting": load.requests_waiting,
                        "requests_running": load.requests_running, "kv_cache_usage": load.kv_cache_usage}
                 for name, load in ctx.load.items()},
        "cache": None if ctx.cache is None else {
            "prompt_tokens": ctx.cache.prompt_tokens, "home": ctx.cache.home, "stay": ctx.cache.stay,
            "cached_tokens": dict(ctx.cache.cached),
            "uncached_tokens": {name: ctx.cache.uncached(name) for name in sorted({*ctx.cache.cached, *ctx.load})}},
    }
    if context is not None:
        report["context"] = context.describe()
    if masking is not None:
        report.setdefault("context", {})[MASK] = masking.describe()
    return report
