"""When to warm (pure): a step that stayed home although its rule wanted the other deployment expects its session's
next step there (for the stays `warm.when` names); a warm-up goes only where there is something to prefill, within
the token cap, on a healthy deployment with nothing waiting, below its cap of warm-ups in flight."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.agents.steps import AgentStep
from gateway.decision.routing import Context, DeploymentLoad, decide
from gateway.decision.switch import SessionCache
from gateway.decision.warmup import Outcome, admit
from gateway.features import extract
from gateway.policy.model import PolicyError, parse
from gateway.policy.switch import WarmPolicy
from tests.decision.test_switch import ERROR, POLICY, ROUTINE, TOOLS

WARM = POLICY + "  warm: {when: [price]}\n"
WARM_ON_STAY_TOO = POLICY + "  warm: {when: [price, min_stay]}\n"
LATE = SessionCache(24_000, {"hq": 4_000, "fast": 23_000}, "fast", 5)  # hq would prefill 20k: an error stays
EARLY = SessionCache(6_000, {"hq": 2_000, "fast": 5_000}, "fast", 3)  # hq lacks 4k: an error moves
JUST_MOVED = SessionCache(24_000, {"hq": 23_000, "fast": 23_000}, "hq", 1)  # min_stay_steps 2 holds it on hq


def warmed(step: AgentStep, cache: SessionCache, policy: str, model: str = "auto") -> tuple[str, str | None]:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "go"}], "tools": TOOLS}
    found = decide(parse(policy), extract(body, "chat"), Context(step=step, cache=cache))
    return found.deployment, found.warm


@pytest.mark.parametrize(("step", "cache", "policy", "expected"), [
    (ERROR, LATE, WARM, ("fast", "hq")),  # stayed on the price: hq is where the next error goes, warm it
    (ERROR, LATE, POLICY, ("fast", None)),  # no warm section: never
    (ERROR, LATE, POLICY + "  warm: {when: []}\n", ("fast", None)),  # warms on no stay
    (ERROR, EARLY, WARM, ("hq", None)),  # it moved: the step itself prefills hq
    (ROUTINE, LATE, WARM, ("fast", None)),  # the rule wants fast, where it is: nothing expected elsewhere
    (ROUTINE, JUST_MOVED, WARM, ("hq", None)),  # held by min_stay_steps: not a stay `price` names
    (ROUTINE, JUST_MOVED, WARM_ON_STAY_TOO, ("hq", "fast")),  # ... unless `when` names min_stay
    (ERROR, SessionCache(24_000, {}, None, 0), WARM, ("hq", None)),  # the session's first step: no home
])
def test_when_a_step_expects_its_next_on_the_other_deployment(
        step: AgentStep, cache: SessionCache, policy: str, expected: tuple[str, str | None]) -> None:
    assert warmed(step, cache, policy) == expected


def test_a_pinned_model_is_never_weighed_nor_warmed() -> None:
    assert warmed(ERROR, LATE, WARM, model="hq") == ("hq", None)


def test_the_trail_says_what_is_warmed_and_why() -> None:
    body: dict[str, Any] = {"model": "auto", "messages": [{"role": "user", "content": "go"}], "tools": TOOLS}
    found = decide(parse(WARM), extract(body, "chat"), Context(step=ERROR, cache=LATE))
    assert found.reasons[-1] == ("switch: warm hq after this step with the session's prompt (stayed on price; its "
                                 "next step is expected there)")


CAPS = WarmPolicy(max_prefill_tokens=30_000, max_in_flight=2, max_waiting=0, max_kv_cache_usage=0.9)
IDLE = DeploymentLoad(requests_waiting=0, kv_cache_usage=0.3)


@pytest.mark.parametrize(("uncached", "load", "warming", "why_not"), [
    (20_000, IDLE, 0, None),
    (20_000, IDLE, 1, None),
    (20_000, IDLE, 2, Outcome.FULL),  # dropped, not queued
    (0, IDLE, 0, Outcome.CACHED),  # it holds the whole prompt already
    (30_001, IDLE, 0, Outcome.TOO_LONG),
    (20_000, DeploymentLoad(requests_waiting=1), 0, Outcome.BUSY),  # a live call waits: it goes first
    (20_000, DeploymentLoad(kv_cache_usage=0.95), 0, Outcome.BUSY),  # would evict live sessions' prefixes
    (20_000, DeploymentLoad(healthy=False), 0, Outcome.UNHEALTHY),
    (20_000, None, 0, Outcome.UNHEALTHY),  # not scraped yet
])
def test_whether_a_warm_up_may_go_now(uncached: int, load: DeploymentLoad | None, warming: int,
                                      why_not: Outcome | None) -> None:
    assert admit(CAPS, uncached, load, warming) == why_not


def test_a_policy_that_warms_on_an_unknown_stay_is_refused() -> None:
    with pytest.raises(PolicyError, match="when"):
        parse(POLICY + "  warm: {when: [always]}\n")
