"""decide() as a table: rules, pins, load spill, health, KV cache, context window, embeddings."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.agents.steps import AgentStep
from gateway.classifier.scoring import Calibration
from gateway.decision.admission import Admission, SessionState
from gateway.decision.routing import Context, DeploymentLoad, decide
from gateway.errors import ContextTooLong, ModelNotFound, NoHealthyDeployment, NotFound, RateLimited
from gateway.features import extract
from gateway.policy import model as policy_module

POLICY = policy_module.parse((Path(__file__).resolve().parents[2] / "policies" / "default.yaml").read_text())
HEALTHY = {"hq": DeploymentLoad(), "fast": DeploymentLoad()}


def _features(**body: object):  # type: ignore[no-untyped-def]
    base: dict[str, object] = {"model": "auto", "messages": [{"role": "user", "content": "hello"}]}
    return extract({**base, **body}, "chat")


def _ctx(**kw: object) -> Context:
    return Context(**{"load": HEALTHY, **kw})  # type: ignore[arg-type]


TOOLS = [{"type": "function", "function": {"name": "f"}}]


@pytest.mark.parametrize(
    ("body", "ctx", "deployment", "rule"),
    [
        ({}, {}, "fast", "default"),
        ({"tools": TOOLS}, {}, "hq", "planning-to-hq"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, {}, "hq",
         "json-schema-to-hq"),
        ({}, {"complexity": 0.9}, "hq", "hard-prompt-to-hq"),
        ({}, {"complexity": 0.05}, "fast", "default"),
        ({"model": "hq"}, {}, "hq", "pin:hq"),
        ({"model": "fast", "tools": TOOLS}, {}, "fast", "pin:fast"),
    ],
)
def test_rule_table(body: dict[str, object], ctx: dict[str, object], deployment: str, rule: str) -> None:
    decision = decide(POLICY, _features(**body), _ctx(**ctx))
    assert (decision.deployment, decision.rule) == (deployment, rule)
    assert decision.attempts[0] == deployment


def test_long_prompt_rule_uses_token_count() -> None:
    long_text = "word " * 7000
    decision = decide(POLICY, _features(messages=[{"role": "user", "content": long_text}]), _ctx())
    assert decision.rule == "long-context-to-hq"


def test_spill_and_its_reason() -> None:
    load = {**HEALTHY, "fast": DeploymentLoad(requests_waiting=16)}
    decision = decide(POLICY, _features(), _ctx(load=load))
    assert decision.deployment == "hq"
    assert any(r.startswith("spill: fast has 16 waiting >= 16") for r in decision.reasons)
    assert decide(POLICY, _features(), _ctx(load={**HEALTHY, "fast": DeploymentLoad(requests_waiting=15)})
                  ).deployment == "fast"


def test_spill_not_to_an_unhealthy_target() -> None:
    load = {"fast": DeploymentLoad(requests_waiting=50), "hq": DeploymentLoad(healthy=False)}
    decision = decide(POLICY, _features(), _ctx(load=load))
    assert decision.deployment == "fast" and decision.attempts == ("fast",)


def test_unhealthy_and_full_deployments_are_skipped() -> None:
    assert decide(POLICY, _features(tools=TOOLS), _ctx(load={**HEALTHY, "hq": DeploymentLoad(healthy=False)})
                  ).deployment == "fast"
    full = {**HEALTHY, "fast": DeploymentLoad(kv_cache_usage=0.99)}
    decision = decide(POLICY, _features(), _ctx(load=full))
    assert decision.deployment == "hq" and "skip fast: KV cache 99% full >= 97%" in decision.reasons
    busy = decide(POLICY, _features(), _ctx(in_flight={"fast": 512}))
    assert busy.deployment == "hq"


def test_nothing_healthy_is_503() -> None:
    with pytest.raises(NoHealthyDeployment):
        decide(POLICY, _features(), _ctx(load={n: DeploymentLoad(healthy=False) for n in HEALTHY}))


def test_unknown_model_is_404() -> None:
    with pytest.raises(ModelNotFound):
        decide(POLICY, _features(model="gpt-9"), _ctx())


def test_context_window() -> None:
    small = policy_module.Policy.model_validate({
        **POLICY.model_dump(), "deployments": {
            "hq": {**POLICY.deployments["hq"].model_dump(), "max_model_len": 4096},
            "fast": {**POLICY.deployments["fast"].model_dump(), "max_model_len": 1024}}})
    medium = _features(messages=[{"role": "user", "content": "word " * 1100}], max_tokens=500)
    decision = decide(small, medium, _ctx())
    assert decision.deployment == "hq" and any("context window 1024 too small" in r for r in decision.reasons)
    with pytest.raises(ContextTooLong) as caught:
        decide(small, _features(messages=[{"role": "user", "content": "word " * 4200}]), _ctx())
    assert caught.value.status == 400 and "context window" in caught.value.message


def test_a_max_tokens_the_window_cannot_hold_is_clamped_and_said_not_refused() -> None:
    """Coding agents ask for 32,000 tokens with a 20,000-token prompt in a 32k window (vLLM generates what is
    left); a refusal is a failed turn for them."""
    small = policy_module.Policy.model_validate({
        **POLICY.model_dump(), "deployments": {
            "hq": {**POLICY.deployments["hq"].model_dump(), "max_model_len": 4096},
            "fast": {**POLICY.deployments["fast"].model_dump(), "max_model_len": 4096}}})
    asked = _features(messages=[{"role": "user", "content": "word " * 900}], max_tokens=32000)
    decision = decide(small, asked, _ctx())
    assert any(r.startswith("context: max_tokens 32000 clamped to the") for r in decision.reasons), decision


def test_embeddings_need_a_deployment_that_serves_them() -> None:
    with pytest.raises(NotFound, match="no deployment serves embeddings"):
        decide(POLICY, extract({"model": "auto", "input": "x"}, "embeddings"), _ctx())


def test_explain_lists_every_rule_checked() -> None:
    decision = decide(POLICY, _features(), _ctx(complexity=0.1), explain=True)
    threshold = Calibration.default().threshold_for_share(0.2)  # the default policy's hq_share
    assert decision.reasons[:7] == (
        "rule tool-error-to-hq: no match (tools=False, wants True)",
        "rule repeated-call-to-hq: no match (tools=False, wants True)",
        "rule routine-tool-step-to-fast: no match (tools=False, wants True)",
        "rule planning-to-hq: no match (tools=False, wants True)",
        "rule long-context-to-hq: no match (prompt_tokens=1, wants gte 6000)",
        "rule json-schema-to-hq: no match (response_format=None, wants 'json_schema')",
        f"rule hard-prompt-to-hq: no match (complexity=0.1, wants the top 20% of the route's traffic: "
        f">= {threshold:.4f} (cold-start threshold))",
    )


@given(st.floats(0, 1), st.floats(0, 40), st.booleans(), st.booleans())
def test_decision_is_always_a_usable_deployment(score: float, waiting: float, hq_ok: bool, fast_ok: bool) -> None:
    load = {"hq": DeploymentLoad(healthy=hq_ok), "fast": DeploymentLoad(healthy=fast_ok, requests_waiting=waiting)}
    try:
        decision = decide(POLICY, _features(), _ctx(load=load, complexity=score))
    except NoHealthyDeployment:
        assert not (hq_ok or fast_ok)
        return
    assert all(load[d].healthy for d in decision.attempts)
    assert decision == decide(POLICY, _features(), replace(_ctx(load=load, complexity=score)))


# --- budget and session verdicts (tenancy.admission) steer the decision -------------------------------

BOTH = frozenset({"hq", "fast"})


@pytest.mark.parametrize(
    ("body", "verdict", "deployment", "reason"),
    [
        ({"tools": TOOLS}, Admission(BOTH, prefer="fast", reasons=("soft limit usd_per_day crossed",)),
         "fast", "admission: soft limit usd_per_day crossed"),
        ({"tools": TOOLS}, Admission(frozenset({"fast"}), reasons=("hq: worst case 0.02 USD > cap",)), "fast",
         "skip hq: not admitted"),
        ({}, Admission(BOTH, prefer="hq", reasons=("session pinned to hq",)), "hq",
         "admission: use hq instead of fast"),
        ({"model": "hq"}, Admission(BOTH, prefer="fast", reasons=("tight loop",)), "fast",
         "admission: tight loop"),
        ({"tools": TOOLS}, Admission(BOTH), "hq", "rule planning-to-hq"),
    ],
)
def test_admission_table(body: dict[str, object], verdict: Admission, deployment: str, reason: str) -> None:
    decision = decide(POLICY, _features(**body), _ctx(admission=verdict))
    assert decision.deployment == deployment
    assert set(decision.attempts) <= verdict.allowed
    assert any(r.startswith(reason) for r in decision.reasons), decision.reasons


@pytest.mark.parametrize(
    ("limit", "code"),
    [("usd_per_day", "budget_exceeded"), ("requests_per_minute", "rate_limit_exceeded"),
     ("session_usd", "budget_exceeded")],
)
def test_refused_verdict_is_429_with_retry_after(limit: str, code: str) -> None:
    verdict = Admission(frozenset(), limit=limit, retry_after_s=12.5)
    with pytest.raises(RateLimited) as caught:
        decide(POLICY, _features(), _ctx(admission=verdict, tenant="acme"))
    assert caught.value.code == code and caught.value.headers["Retry-After"] == "13"
    assert caught.value.status == 429


def test_nothing_admitted_is_usable_when_the_allowed_one_is_unhealthy() -> None:
    load = {**HEALTHY, "fast": DeploymentLoad(healthy=False)}
    with pytest.raises(NoHealthyDeployment):
        decide(POLICY, _features(), _ctx(admission=Admission(frozenset({"fast"})), load=load))


@given(prefer=st.sampled_from([None, "hq", "fast"]), allowed=st.sampled_from([BOTH, {"hq"}, {"fast"}]),
       tools=st.booleans(), fast_ok=st.booleans())
def test_never_outside_allowed(prefer: str | None, allowed: set[str], tools: bool, fast_ok: bool) -> None:
    load = {**HEALTHY, "fast": DeploymentLoad(healthy=fast_ok)}
    verdict = Admission(frozenset(allowed), prefer=prefer if prefer in allowed else None)
    try:
        decision = decide(POLICY, _features(**({"tools": TOOLS} if tools else {})),
                          _ctx(admission=verdict, load=load))
    except NoHealthyDeployment:
        assert allowed == {"fast"} and not fast_ok
        return
    assert set(decision.attempts) <= verdict.allowed
    if verdict.prefer is not None and (verdict.prefer != "fast" or fast_ok):
        assert decision.deployment == verdict.prefer


PLAN = AgentStep(step=1, turn="user", tool_error=False, repeated_calls=0)
ROUTINE = AgentStep(step=3, turn="tool_result", tool_error=False, repeated_calls=1)
FAILED = AgentStep(step=4, turn="tool_result", tool_error=True, repeated_calls=1)
LOOPING = AgentStep(step=6, turn="tool_result", tool_error=False, repeated_calls=3)


@pytest.mark.parametrize(
    ("step", "deployment", "rule"),
    [
        (PLAN, "hq", "planning-to-hq"),
        (ROUTINE, "fast", "routine-tool-step-to-fast"),
        (FAILED, "hq", "tool-error-to-hq"),
        (LOOPING, "hq", "repeated-call-to-hq"),
        (replace(LOOPING, repeated_calls=1, step=7), "fast", "routine-tool-step-to-fast"),  # recovered
    ],
)
def test_agent_steps_go_where_each_deployment_is_for(step: AgentStep, deployment: str, rule: str) -> None:
    decision = decide(POLICY, _features(tools=TOOLS), _ctx(step=step))
    assert (decision.deployment, decision.rule) == (deployment, rule)


def test_the_trail_names_the_trajectory_feature_that_decided() -> None:
    decision = decide(POLICY, _features(tools=TOOLS), _ctx(step=FAILED), explain=True)
    assert "rule tool-error-to-hq: matched, use hq (trajectory: tool_error=True)" in decision.reasons


def test_a_trajectory_rule_wins_over_the_session_pin_but_not_over_a_budget() -> None:
    pinned = Admission(BOTH, prefer="hq", reasons=("session pinned to hq",), session_prefers=True)
    decision = decide(POLICY, _features(tools=TOOLS), _ctx(step=ROUTINE, admission=pinned))
    assert decision.deployment == "fast"
    assert any("trajectory rule wins" in r for r in decision.reasons)
    # a rule that does not read the trajectory still follows the pin
    assert decide(POLICY, _features(), _ctx(admission=pinned)).deployment == "hq"
    soft = Admission(BOTH, prefer="fast", reasons=("soft limit usd_per_day crossed",))
    assert decide(POLICY, _features(tools=TOOLS), _ctx(step=FAILED, admission=soft)).deployment == "fast"


@pytest.mark.parametrize(
    ("ctx", "body", "served"),
    [
        ({}, {}, True),
        ({"load": {**HEALTHY, "hq": DeploymentLoad(healthy=False)}}, {}, False),
        ({"load": {**HEALTHY, "hq": DeploymentLoad(kv_cache_usage=1.0)}}, {}, False),
        ({"admission": Admission(frozenset({"fast"}))}, {}, False),  # a budget, refusal or cost cap dropped it
        ({}, {"messages": [{"role": "user", "content": "word " * 2100}]}, False),  # its window cannot hold the prompt
    ],
    ids=["admitted", "unhealthy", "kv-cache-full", "not-admitted", "context-window"],
)
def test_a_rollout_candidate_is_substituted_only_where_decide_would_send_it(
    ctx: dict[str, object], body: dict[str, object], served: bool
) -> None:
    from gateway.decision.routing import substitute

    small_hq = POLICY.deployments["hq"].model_copy(update={"max_model_len": 2048})
    policy = POLICY.model_copy(update={"deployments": {**POLICY.deployments, "hq": small_hq}})
    live = decide(policy, _features(), _ctx())
    found = substitute(policy, _features(**body), _ctx(**ctx), live, "hq")
    assert (found is not None) is served
    if found is not None:
        assert found.deployment == "hq" and found.attempts == ("hq", "fast")
def test_a_stopped_agent_session_is_429_naming_its_loop() -> None:
    from gateway.agents.loops import AgentVerdict

    stop = AgentVerdict("loop:repeated_tool_call", "stop", "hq", "search(args ab) 5 times", 3600.0)
    with pytest.raises(RateLimited) as refused:
        decide(POLICY, _features(), _ctx(agent=stop))
    assert refused.value.code == "agent_loop_detected" and refused.value.headers["Retry-After"] == "3600"
    assert "loop:repeated_tool_call (search(args ab) 5 times)" in refused.value.message


def test_an_escalated_loop_and_a_steered_spike_redirect_after_the_rules() -> None:
    from gateway.agents.loops import AgentVerdict

    escalate = AgentVerdict("loop:repeated_output", "escalate", "hq", "assistant message 12 4 times")
    decision = decide(POLICY, _features(), _ctx(agent=escalate))
    assert (decision.deployment, decision.rule) == ("hq", "default")
    assert decision.reasons[-2:] == ("agent: loop:repeated_output (assistant message 12 4 times): escalate",
                                     "agent: use hq instead of fast")
    steer = AgentVerdict("spike:session", "steer", "fast", "0.9 USD/min")
    assert decide(POLICY, _features(tools=TOOLS), _ctx(agent=steer)).deployment == "fast"
    # a deployment the budget does not admit stays out, whatever the agent verdict asks
    budget = Admission(frozenset({"fast"}))
    assert decide(POLICY, _features(), _ctx(agent=escalate, admission=budget)).attempts == ("fast",)


# A rule per kind of condition (feature field, tools, model, tenant, score, header, step, session, ranges, lists):
# the hot path's tests, made once per policy, must pick what the explaining path (which reads each condition
# afresh) picks.
EVERY_CONDITION = policy_module.parse("""
version: 1
deployments:
  hq: {url: "http://127.0.0.1:1", served_model: m}
  fast: {url: "http://127.0.0.1:2", served_model: m}
models:
  auto: {route: rules}
  fast: {pin: fast}
rules:
  - {name: header, when: {headers: {x-team: [red, blue]}}, use: hq}
  - {name: tenant, when: {tenant: acme}, use: hq}
  - {name: no-tools-stream, when: {tools: false, stream: true}, use: hq}
  - {name: step, when: {turn: tool_result, tool_error: true}, use: hq, override_pin: true}
  - {name: repeats, when: {repeated_calls: {gte: 3}, step: {lt: 20}}, use: hq}
  - {name: session, when: {steps_per_min: {gt: 30}}, use: fast}
  - {name: spend, when: {session_cost_usd: {gte: 1.5}}, use: fast}
  - {name: code, when: {has_code: true, message_count: {gte: 2, lte: 4}}, use: hq}
  - {name: score, when: {complexity: {gte: 0.7}, model: auto}, use: hq}
  - {name: format, when: {response_format: [json_object, json_schema], max_tokens: {eq: 64}}, use: hq}
  - {name: tools, when: {tools: true}, use: fast}
default: fast
""")


@given(
    headers=st.sampled_from([{}, {"x-team": "red"}, {"x-team": "green"}]),
    tenant=st.sampled_from([None, "acme", "other"]),
    body=st.fixed_dictionaries({
        "model": st.sampled_from(["auto", "fast"]),
        "stream": st.booleans(),
        "max_tokens": st.sampled_from([16, 64]),
        "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
        "messages": st.sampled_from([[{"role": "user", "content": "hi"}],
                                     [{"role": "user", "content": "a"}, {"role": "user", "content": "x == y"}]]),
    }, optional={"tools": st.just(TOOLS)}),
    complexity=st.sampled_from([None, 0.2, 0.7, 0.9]),
    step=st.sampled_from([None, AgentStep(3, "tool_result", True, 1), AgentStep(25, "user", False, 4),
                          AgentStep(2, "tool_result", False, 3)]),
    session=st.sampled_from([None, SessionState("s", steps_per_min=40.0), SessionState("s", cost_usd=2.0)]),
)
def test_the_hot_path_picks_the_rule_the_explaining_path_picks(
    headers: dict[str, str], tenant: str | None, body: dict[str, object], complexity: float | None,
    step: AgentStep | None, session: SessionState | None,
) -> None:
    ctx = _ctx(headers=headers, tenant=tenant, complexity=complexity, step=step, session=session)
    features = extract(body, "chat")
    fast, explained = decide(EVERY_CONDITION, features, ctx), decide(EVERY_CONDITION, features, ctx, explain=True)
    assert (fast.rule, fast.attempts) == (explained.rule, explained.attempts)
    assert set(fast.reasons) <= set(explained.reasons)
