"""The policy's `switch` section: what moving an agent session to the other deployment costs, and when it may.

A step re-sends its session's whole conversation; the deployment that served the last step holds it in its
prefix cache, the other prefills what it has not seen. With this section, a step whose rule wants the other
deployment moves only when the rule's reason (`worth_ms`) outweighs the price of the tokens that deployment has
not cached (their prefill time, and their input price at `ms_per_usd`), and not within `min_stay_steps` of the
session's last move. Deployment and rule names are checked by Policy's reference check.
"""

from __future__ import annotations

from pydantic import Field

from gateway.frozen import Frozen

DEFAULT_RULE = "default"  # the rule name of a step no rule matched (decision/routing.py)


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

    def worth_of(self, rule: str) -> float:
        return self.worth_ms.get(rule, self.default_worth_ms)

    def prefill_ms(self, deployment: str, tokens: int) -> float:
        return self.prefill_ms_per_1k_tokens.get(deployment, 0.0) * tokens / 1000
