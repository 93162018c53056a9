"""The switch price in the decision: a step stays where its session's cache is unless its rule's reason outweighs
what the move adds to the prefill, and a session that moved stays `min_stay_steps`."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.agents.steps import AgentStep
from gateway.decision.routing import Context, decide
from gateway.decision.switch import SessionCache
from gateway.features import extract
from gateway.policy.model import Policy, PolicyError, parse

POLICY = """
deployments:
  hq: {url: "http://hq", served_model: hq, price: {input_per_mtok_usd: 3.0}}
  fast: {url: "http://fast", served_model: fast, price: {input_per_mtok_usd: 0.5}}
models:
  auto: {route: rules}
  hq: {pin: hq}
rules:
  - {name: tool-error-to-hq, when: {tools: true, tool_error: true}, use: hq}
  - {name: routine-tool-step-to-fast, when: {tools: true, turn: tool_result}, use: fast}
default: fast
switch:
  prefill_ms_per_1k_tokens: {hq: 100, fast: 60}
  worth_ms: {tool-error-to-hq: 1000}
  default_worth_ms: 300
  min_stay_steps: 2
"""
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
ERROR = AgentStep(step=9, turn="tool_result", tool_error=True, repeated_calls=1)
ROUTINE = AgentStep(step=9, turn="tool_result", tool_error=False, repeated_calls=1)


def decided(step: AgentStep, cache: SessionCache | None, *, model: str = "auto", policy: str = POLICY,
            explain: bool = False) -> tuple[str, tuple[str, ...]]:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "go"}], "tools": TOOLS}
    found = decide(parse(policy), extract(body, "chat"), Context(step=step, cache=cache), explain=explain)
    return found.deployment, found.reasons


@pytest.mark.parametrize(("step", "cache", "served", "said"), [
    # an error late in a session: hq would prefill 20,000 tokens (~2 s) for a reason worth 1 s: stays on fast
    (ERROR, SessionCache(24_000, {"hq": 4_000, "fast": 23_000}, "fast", 5), "fast",
     "switch: stays on fast: hq would prefill 20,000 tokens, fast 1,000 (~1,940 ms more) against rule "
     "tool-error-to-hq's worth 1,000 ms"),
    # the same error early, or with hq close behind: the reason outweighs the price, it moves
    (ERROR, SessionCache(6_000, {"hq": 2_000, "fast": 5_000}, "fast", 3), "hq",
     "switch: moves to hq: hq would prefill 4,000 tokens, fast 1,000 (~340 ms more) against rule "
     "tool-error-to-hq's worth 1,000 ms"),
    # back to fast after hq served a step: fast lacks only what hq served since, cheap: it moves
    (ROUTINE, SessionCache(24_000, {"hq": 23_000, "fast": 21_000}, "hq", 2), "fast",
     "switch: moves to fast: fast would prefill 3,000 tokens, hq 1,000 (~80 ms more) against rule "
     "routine-tool-step-to-fast's worth 300 ms"),
    # hysteresis: a session that moved one step ago stays, whatever the rule wants
    (ROUTINE, SessionCache(24_000, {"hq": 23_000, "fast": 23_000}, "hq", 1), "hq",
     "switch: stays on hq: it arrived 1 step(s) ago, min_stay_steps 2"),
    # the session's first step: no home, the rules decide
    (ERROR, SessionCache(3_000, {}, None, 0), "hq", None),
    # already where the rule wants: nothing to weigh
    (ROUTINE, SessionCache(24_000, {"fast": 23_000}, "fast", 7), "fast", None),
    # no prediction (no session): the rules decide
    (ERROR, None, "hq", None),
])
def test_a_step_stays_on_its_cache_unless_the_reason_outweighs_the_price(
        step: AgentStep, cache: SessionCache | None, served: str, said: str | None) -> None:
    deployment, reasons = decided(step, cache)
    assert deployment == served
    switch_lines = [r for r in reasons if r.startswith("switch:")]
    assert switch_lines == ([said] if said else [])


def test_money_weighs_in_at_ms_per_usd() -> None:
    # 20,000 uncached tokens on hq cost $0.06 more than 1,000 on fast: at 10,000 ms per USD that is 600 ms more
    policy = POLICY.replace("min_stay_steps: 2", "min_stay_steps: 2\n  ms_per_usd: 10000")
    cache = SessionCache(24_000, {"hq": 4_000, "fast": 23_000}, "fast", 5)
    _, reasons = decided(ERROR, cache, policy=policy)
    assert "(~2,535 ms more)" in next(r for r in reasons if r.startswith("switch:"))


def test_weight_zero_makes_switches_free() -> None:
    cache = SessionCache(24_000, {"hq": 0, "fast": 23_000}, "fast", 5)
    assert decided(ERROR, cache, policy=POLICY.replace("min_stay_steps: 2", "weight: 0"))[0] == "hq"


def test_a_pinned_model_is_not_weighed() -> None:
    assert decided(ROUTINE, SessionCache(24_000, {"hq": 0, "fast": 24_000}, "fast", 5), model="hq")[0] == "hq"


def test_explain_shows_each_deployments_uncached_tokens() -> None:
    _, reasons = decided(ERROR, SessionCache(24_000, {"hq": 4_000, "fast": 23_000}, "fast", 5), explain=True)
    assert ("cache: prompt 24,000 tokens: hq holds 4,000 (would prefill 20,000), fast holds 23,000 "
            "(would prefill 1,000); last step on fast (5 in a row)") in reasons


@pytest.mark.parametrize(("change", "problem"), [
    ("prefill_ms_per_1k_tokens: {hq: 100, fast: 60}", "prefill_ms_per_1k_tokens: {hq: 100, slow: 60}"),
    ("worth_ms: {tool-error-to-hq: 1000}", "worth_ms: {tool-eror-to-hq: 1000}"),
    ("min_stay_steps: 2", "min_stay_steps: 0"),
    ("default_worth_ms: 300", "default_worth_ms: -1"),
])
def test_a_bad_switch_section_names_its_file_field_and_value(change: str, problem: str) -> None:
    with pytest.raises(PolicyError) as err:
        parse(POLICY.replace(change, problem), "policy.yaml")
    expected = {
        "slow": "policy.yaml:13: switch.prefill_ms_per_1k_tokens.slow: unknown deployment 'slow' "
                "(known: ['fast', 'hq'])",
        "eror": "policy.yaml:14: switch.worth_ms.tool-eror-to-hq: unknown rule 'tool-eror-to-hq' "
                "(rules: ['default', 'routine-tool-step-to-fast', 'tool-error-to-hq'])",
        "min_stay": "policy.yaml:16: switch.min_stay_steps: Input should be greater than or equal to 1 (value: 0)",
        "default_worth": "policy.yaml:15: switch.default_worth_ms: Input should be greater than or equal to 0 "
                         "(value: -1)",
    }
    key = next(k for k in expected if k in problem)
    assert err.value.problems == [expected[key]]


def test_the_default_policy_prices_switches() -> None:
    from pathlib import Path

    from gateway.policy.model import load
    policy: Policy = load(Path(__file__).resolve().parents[2] / "policies" / "default.yaml")
    assert policy.switch is not None and policy.switch.min_stay_steps >= 2
