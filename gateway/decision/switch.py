"""The switch cost of a step (pure): stay on the deployment that holds the session's prefix cache, or move.

    cache = SessionCache(prompt_tokens, {"hq": 3_100, "fast": 24_100}, home="fast", stay=4)
    weighed = weigh(policy, policy.switch, rule, wanted, cache, trail)    # decide() calls it after the rules
    weighed.deployment, weighed.stayed                                     # where it goes; why it did not move

The price of moving from `home` (the deployment that served the session's last step) to `wanted` is the prefill
the move adds: what `wanted` has not cached minus what `home` has not, in time and in input price. The rule's
reason to move (`worth_ms`) must outweigh it, and a session that just moved stays `min_stay_steps`, so a
session does not flap between two deployments, each prefilling what the other served meanwhile.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.context.prefix import Chain, SessionPrefixes, common_tokens
from gateway.policy.model import Policy
from gateway.policy.switch import StayReason, SwitchPolicy


@dataclass(frozen=True, slots=True)
class SessionCache:
    """What each deployment's prefix cache holds of this call's prompt, as the gateway predicts it from the
    session's record (context/prefix.py), and where the session has been."""

    prompt_tokens: int
    cached: Mapping[str, int] = field(default_factory=dict)  # deployment -> tokens of this prompt it holds
    home: str | None = None  # the deployment that served the session's last step; None: its first step
    stay: int = 0  # the session's steps on `home` in a row
    warmed: frozenset[str] = frozenset()  # deployments holding what a warm-up, not a served step, put there

    def uncached(self, deployment: str) -> int:
        """The tokens `deployment` would prefill to serve this prompt."""
        return max(0, self.prompt_tokens - self.cached.get(deployment, 0))


@dataclass(frozen=True, slots=True)
class Price:
    """What moving a step from `home` to `to` adds to its prefill."""

    to: str
    tokens: int  # the extra tokens prefilled (what `to` lacks beyond what `home` lacks)
    ms: float  # their prefill time and input price, weighted


def price(policy: Policy, switch: SwitchPolicy, cache: SessionCache, home: str, to: str) -> Price:
    there, here = cache.uncached(to), cache.uncached(home)
    ms = switch.prefill_ms(to, there) - switch.prefill_ms(home, here)
    if switch.ms_per_usd:
        usd = (there * _input_price(policy, to) - here * _input_price(policy, home)) / 1e6
        ms += usd * switch.ms_per_usd
    return Price(to, there - here, switch.weight * ms)


def _input_price(policy: Policy, name: str) -> float:
    found = policy.deployments.get(name)
    return found.price.input_per_mtok_usd if found is not None else 0.0


@dataclass(frozen=True, slots=True)
class Weighed:
    """Where the switch price sends a step, and, when it stayed on its home although the rules wanted to move,
    why (the warm-up reads it: the next step is expected on `wanted`)."""

    deployment: str
    stayed: StayReason | None = None


def weigh(policy: Policy, switch: SwitchPolicy, rule: str, wanted: str, cache: SessionCache,
          trail: list[str]) -> Weighed:
    """Where the step goes: `wanted` (the rules' choice) unless staying on the session's home is cheaper than
    the rule's reason to move is worth, or the session moved fewer than `min_stay_steps` ago."""
    home = cache.home
    if home is None or home == wanted or home not in policy.deployments:
        return Weighed(wanted)
    if cache.stay < switch.min_stay_steps:
        trail.append(f"switch: stays on {home}: it arrived {cache.stay} step(s) ago, "
                     f"min_stay_steps {switch.min_stay_steps}")
        return Weighed(home, "min_stay")
    cost = price(policy, switch, cache, home, wanted)
    worth = switch.worth_of(rule)
    said = (f"{wanted} would prefill {cache.uncached(wanted):,} tokens, {home} {cache.uncached(home):,} "
            f"(~{cost.ms:,.0f} ms more) against rule {rule}'s worth {worth:,.0f} ms")
    if cost.ms > worth:
        trail.append(f"switch: stays on {home}: {said}")
        return Weighed(home, "price")
    trail.append(f"switch: moves to {wanted}: {said}")
    return Weighed(wanted)


def holdings(cache: SessionCache, deployments: list[str]) -> str:
    """The trail's line of each deployment's cached and uncached tokens of this prompt."""
    held = ", ".join(f"{name} holds {cache.cached.get(name, 0):,}{' warmed' if name in cache.warmed else ''} "
                     f"(would prefill {cache.uncached(name):,})" for name in deployments)
    where = f"; last step on {cache.home} ({cache.stay} in a row)" if cache.home else "; the session's first step"
    return f"cache: prompt {cache.prompt_tokens:,} tokens: {held}{where}"


def session_cache(record: SessionPrefixes, prompt: Chain) -> SessionCache:
    """This prompt's SessionCache from the session's record: what each deployment served it last, matched
    link by link against the prompt (the live gateway and every offline replay build it here)."""
    cached = {name: common_tokens(chain, prompt) for name, chain in record.served.items()}
    return SessionCache(prompt.total, cached, record.home, record.stay, record.warmed)


def expected_next(switch: SwitchPolicy, wanted: str, weighed: Weighed, chosen: str, trail: list[str]) -> str | None:
    """The deployment this session's next step is expected on, to be warmed after this step (`switch.warm`): the
    one the rules wanted when the step stayed home for a reason `warm.when` names. None: no warm-up."""
    warm = switch.warm
    if warm is None or weighed.stayed is None or weighed.stayed not in warm.when or chosen == wanted:
        return None
    trail.append(f"switch: warm {wanted} after this step with the session's prompt (stayed on {weighed.stayed}; "
                 f"its next step is expected there)")
    return wanted
