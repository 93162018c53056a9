"""The policy's `switch` section: what moving an agent session to the other deployment costs, and when it may.

A step re-sends its session's whole conversation; the deployment that served the last step holds it in its
prefix cache, the other prefills what it has not seen. With this section, a step whose rule wants the other
deployment moves only when the rule's reason (`worth_ms`) outweighs the price of the tokens that deployment has
not cached (their prefill time, and their input price at `ms_per_usd`), and not within `min_stay_steps` of the
session's last move. Deployment and rule names are checked by Policy's reference check.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gateway.frozen import Frozen

DEFAULT_RULE = "default"  # the rule name of a step no rule matched (decision/routing.py)
# Why a step stayed on its session's home while its rule wanted the other deployment (decision/switch.py):
#   price     the prefill the move would add outweighed the rule's worth
#   min_stay  the session moved fewer than min_stay_steps ago
StayReason = Literal["price", "min_stay"]


def _price_only() -> list[StayReason]:
    return ["price"]


class WarmPolicy(Frozen):
    """Warm-ups: a step that stayed although its rule wanted the other deployment expects the session's next step
    there; while the agent's tool runs, that deployment prefills the session's prompt (`max_tokens: 1`), so the
    move, when it comes, finds the prefix cached. Bounded, and only on a deployment with nothing waiting."""

    when: list[StayReason] = Field(
        default_factory=_price_only,
        description="the stays that warm the wanted deployment: `price` (the move cost more prefill than the rule's "
                    "worth), `min_stay` (the session moved fewer than min_stay_steps ago); [] warms never")
    max_prefill_tokens: int = Field(65_536, ge=1, description="a warm-up that would prefill more tokens than this "
                                                               "(the target's predicted uncached ones) is skipped")
    max_in_flight: int = Field(2, ge=1, le=64, description="warm-ups in flight per deployment (per gateway "
                                                           "process); one beyond is dropped, never queued")
    max_waiting: float = Field(0.0, ge=0, description="a deployment with more requests waiting than this "
                                                      "(vllm:num_requests_waiting) is not warmed: live calls first")
    max_kv_cache_usage: float = Field(0.9, ge=0, le=1, description="nor one whose KV cache is fuller than this "
                                                                   "(a warm-up would evict live sessions' prefixes)")
    timeout_s: float = Field(30.0, gt=0, le=600, description="a warm-up's whole call, at most")


class SwitchPolicy(Frozen):
    """Routing that keeps each agent session's prefix cache: a switch has a price in the decision."""

    prefill_ms_per_1k_tokens: dict[str, float] = Field(
        description="deployment -> milliseconds it takes to prefill 1,000 tokens it has not cached")
    ms_per_usd: float = Field(0.0, ge=0, description="a dollar of uncached input weighs as this many ms of "
                                                     "prefill (0: the price is the prefill time alone)")
    weight: float = Field(1.0, ge=0, description="multiplies the price (0: switches are free, the rules decide)")
    worth_ms: dict[str, float] = Field(
        default_factory=dict,
        description="rule name (or `default`) -> the prefill time its reason to move is worth, in ms")
    default_worth_ms: float = Field(0.0, ge=0, description="the worth of a rule `worth_ms` does not name")
    min_stay_steps: int = Field(1, ge=1, le=100, description="a session that moved stays where it moved this "
                                                             "many steps, whatever the rules want")
    ttl_s: int = Field(3600, ge=60, description="a session's cache record idle this long is forgotten")
    warm: WarmPolicy | None = Field(None, description="prefill the deployment a session's next step is expected on "
                                                      "while the agent's tool runs; absent: never")

    def worth_of(self, rule: str) -> float:
        return self.worth_ms.get(rule, self.default_worth_ms)

    def prefill_ms(self, deployment: str, tokens: int) -> float:
        return self.prefill_ms_per_1k_tokens.get(deployment, 0.0) * tokens / 1000
