"""decide(): the pure routing decision from policy, request features and a snapshot of the world."""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.agents.loops import AgentVerdict
from gateway.agents.steps import AgentStep
from gateway.decision import windows
from gateway.decision.admission import Admission, SessionState
from gateway.decision.agent_compaction import compaction_asker
from gateway.decision.switch import SessionCache, Weighed, expected_next, holdings, weigh
from gateway.errors import ContextTooLong, ModelNotFound, NoHealthyDeployment, NotFound, RateLimited
from gateway.features import Features
from gateway.policy.model import TRAJECTORY_CONDITIONS, ComplexityShare, Policy, Range, Rule, When

RATE_LIMITS = frozenset({"requests_per_minute", "concurrent"})  # the rest are budgets
STEP_FEATURES = frozenset({"turn", "step", "tool_error", "repeated_calls"})  # read from Context.step


@dataclass(frozen=True, slots=True)
class DeploymentLoad:
    """What the gateway last saw of one deployment (health checks, /metrics scrapes, in-flight count)."""

    healthy: bool = True
    requests_waiting: float = 0.0
    requests_running: float = 0.0
    kv_cache_usage: float = 0.0


# Context and Decision are built per request: not frozen (frozen dataclasses pay object.__setattr__ per
# field), but treated as immutable.
@dataclass(slots=True)
class Context:
    """Everything besides the request body that a decision reads; gathered before decide() is called."""

    headers: Mapping[str, str] = field(default_factory=dict)  # lower-case names
    tenant: str | None = None
    complexity: float | None = None
    load: Mapping[str, DeploymentLoad] = field(default_factory=dict)
    in_flight: Mapping[str, int] = field(default_factory=dict)
    admission: Admission | None = None  # the tenant's budget and session verdict; None: no limits apply
    session: SessionState | None = None  # the agent session as the store counted this step
    # target share -> the live score threshold of this request's route (decision/share.py); a share
    # missing here uses its cold-start threshold from the policy's calibration
    share_thresholds: Mapping[float, float] = field(default_factory=dict)
    step: AgentStep | None = None  # where the call stands in its agent loop, when a rule reads it
    agent: AgentVerdict | None = None  # what the session's active loop or spike flags ask for; None: nothing
    cache: SessionCache | None = None  # each deployment's predicted prefix cache of this prompt (policy `switch`)
    # each deployment's window against the call, in its own tokens (decision/windows.py); a deployment missing
    # here is judged by the policy's max_model_len and the cl100k count
    fits: Mapping[str, windows.Fit] = field(default_factory=dict)


@dataclass(slots=True)
class Decision:
    deployment: str
    rule: str
    attempts: tuple[str, ...]  # failover order, the chosen deployment first
    reasons: tuple[str, ...] = ()
    warm: str | None = None  # the deployment to warm with the prompt after the answer (decision/warmup.py)


NO_LOAD = DeploymentLoad()


def decide(policy: Policy, features: Features, ctx: Context, *, explain: bool = False) -> Decision:
    """Pick the deployment for one request.

    The reasons always name the deciding rule and any load or health adjustment; with explain=True they
    also say why every earlier rule did not match.
    """
    model = policy.models.get(features.requested_model)
    if model is None:
        raise ModelNotFound(
            f"The model {features.requested_model!r} does not exist; available: {', '.join(policy.models)}",
            param="model",
        )
    verdict = ctx.admission
    if verdict is not None and verdict.refused:
        raise _refusal(verdict, ctx.tenant)
    if ctx.agent is not None and ctx.agent.action == "stop":
        raise _stopped(ctx.agent)
    if features.endpoint == "embeddings":
        return _embeddings(policy, model.pin, ctx)
    trail: list[str] = []
    wanted, rule_name, by_trajectory = _select(policy, model.pin, features, ctx, trail, explain)
    weighed = _priced(policy, model.pin, rule_name, wanted, ctx, trail, explain)
    chosen, reason = _adjust_for_load(policy, weighed.deployment, features, ctx)
    if reason:
        trail.append(reason)
    if verdict is not None:
        chosen = _steer(verdict, chosen, trail, by_trajectory)
    chosen = _for_the_agent(policy, chosen, features, ctx, trail)
    attempts = _usable(policy, chosen, features, ctx, trail)
    clamped = _clamped(policy, attempts[0], features, ctx)
    if clamped is not None:
        trail.append(clamped)
    warm = expected_next(policy.switch, wanted, weighed, attempts[0], trail) if policy.switch is not None else None
    if explain:
        trail.append(f"attempt order: {', '.join(attempts)}")
    return Decision(attempts[0], rule_name, attempts, tuple(trail), warm)


def substitute(policy: Policy, features: Features, ctx: Context, live: Decision, candidate: str) -> Decision | None:
    """The live decision with a rollout's candidate deployment in its chosen place, or None when the candidate
    may not serve this request: the same admission as any deployment (budgets, soft-limit refusals, the cost
    cap, health, context window, endpoint, load), so an arm never sends a call where decide() would not."""
    why = _exclusion(policy, candidate, features, ctx)
    if why is not None:
        return None
    attempts = (candidate, *(a for a in live.attempts if a != candidate))[: policy.max_attempts]
    return Decision(candidate, f"rollout:{candidate}", attempts,
                    (*live.reasons, f"rollout candidate deployment:{candidate}"))


def _refusal(verdict: Admission, tenant: str | None) -> RateLimited:
    who = f"Tenant {tenant!r}" if tenant else "This client"
    what = "this session's cost cap" if verdict.limit == "session_usd" else f"its {verdict.limit} limit"
    return RateLimited(
        f"{who} reached {what}; retry after {verdict.retry_after_s:.0f} s",
        retry_after_s=verdict.retry_after_s,
        code="rate_limit_exceeded" if verdict.limit in RATE_LIMITS else "budget_exceeded",
    )


def _stopped(agent: AgentVerdict) -> RateLimited:
    return RateLimited(
        f"This agent session is stopped: {agent.flag} ({agent.detail}); the policy's agents section stops it",
        retry_after_s=agent.retry_after_s,
        code=agent.code,
    )


def _priced(policy: Policy, pin: str | None, rule: str, wanted: str, ctx: Context, trail: list[str],
            explain: bool) -> Weighed:
    """The rules' choice weighed against the session's prefix cache (decision/switch.py), when the policy prices
    switches and the model is routed by the rules: before load, budget and agent flags, which still steer."""
    cache = ctx.cache
    if cache is None or policy.switch is None or pin is not None:
        return Weighed(wanted)
    if explain:
        trail.append(holdings(cache, list(policy.deployments)))
    return weigh(policy, policy.switch, rule, wanted, cache, trail)


def _redirect(policy: Policy, agent: AgentVerdict, chosen: str, trail: list[str]) -> str:
    """A loop escalates (to hq), a cost spike steers (to fast): after the rules, load and budget steer."""
    target = agent.target
    trail.append(f"agent: {agent.flag} ({agent.detail}): {agent.action}")
    if target is None or target == chosen or target not in policy.deployments:
        return chosen
    trail.append(f"agent: use {target} instead of {chosen}")
    return target


def _steer(verdict: Admission, chosen: str, trail: list[str], by_trajectory: bool) -> str:
    """Budget, cost cap and session steer after the rules and load: soft limit, tight loop, session pin.

    A rule that read the agent's trajectory (a tool error, a repeated call, a planning turn) knows more
    about this step than the session's pin or step rate, so it wins over them; budgets still win over it.
    """
    trail.extend(f"admission: {why}" for why in verdict.reasons)
    if verdict.prefer is None or verdict.prefer == chosen:
        return chosen
    if by_trajectory and verdict.session_prefers:
        trail.append(f"trajectory rule wins over the session's preference for {verdict.prefer}")
        return chosen
    trail.append(f"admission: use {verdict.prefer} instead of {chosen}")
    return verdict.prefer


def _embeddings(policy: Policy, pin: str | None, ctx: Context) -> Decision:
    """Vectors from different models do not mix: one deployment, named by the pin or the first that embeds."""
    serving = [name for name, dep in policy.deployments.items() if "embeddings" in dep.endpoints]
    name = pin if pin in serving else (serving[0] if serving and pin is None else None)
    if name is None:
        where = f"deployment {pin!r} does not serve embeddings" if pin else "no deployment serves embeddings"
        raise NotFound(f"Embeddings are not available for this model: {where}; "
                       f"models with embeddings: {', '.join(serving) or 'none'}", param="model",
                       code="embeddings_not_served")
    if not ctx.load.get(name, NO_LOAD).healthy:
        raise NoHealthyDeployment(f"The embeddings deployment {name!r} is unhealthy; retry shortly")
    return Decision(name, "embeddings", (name,), (f"embeddings served by {name}",))


def _select(
    policy: Policy, pin: str | None, features: Features, ctx: Context, trail: list[str], explain: bool
) -> tuple[str, str, bool]:
    """The deployment the rules want, the deciding rule, and whether that rule read the trajectory."""
    for rule, tests in _rule_tests(policy):
        if pin is not None and not rule.override_pin:
            continue
        if explain:
            failed = _first_failure(rule.when, features, ctx, explain)
        else:  # the hot path: the policy's tests, the same first failure as _first_failure's, in one loop
            failed = None
            for name, test in tests:
                if not test(features, ctx):
                    failed = name
                    break
        if failed is None:
            trail.append(f"rule {rule.name}: matched, use {rule.use}" + _trajectory_note(rule.when, ctx))
            return rule.use, rule.name, rule.when.reads_trajectory
        if explain:
            trail.append(f"rule {rule.name}: no match ({failed})")
    if pin is not None:
        trail.append(f"model {features.requested_model!r} pins deployment {pin!r}")
        return pin, f"pin:{features.requested_model}", False
    trail.append(f"no rule matched: default {policy.default!r}")
    return policy.default, "default", False


def _trajectory_note(when: When, ctx: Context) -> str:
    """Which trajectory features decided, so `policy explain` and the trail name them."""
    if not when.reads_trajectory:
        return ""
    read = [f"{name}={_trajectory_feature(name, ctx)!r}" for name, _ in when.conditions
            if name in TRAJECTORY_CONDITIONS]
    return f" (trajectory: {', '.join(read)})"


def _adjust_for_load(policy: Policy, name: str, features: Features, ctx: Context) -> tuple[str, str]:
    """Spill away from a deployment whose queue is deeper than its threshold."""
    limits = policy.deployments[name].load
    load = ctx.load.get(name, NO_LOAD)
    spill_to = limits.spill_to
    if spill_to is None or limits.spill_when_waiting_gte is None:
        return name, ""
    if load.requests_waiting < limits.spill_when_waiting_gte:
        return name, ""
    if not _fits(policy, spill_to, features, ctx) or not ctx.load.get(spill_to, NO_LOAD).healthy:
        return name, f"spill from {name} to {spill_to} skipped: {spill_to} cannot take it"
    return spill_to, (
        f"spill: {name} has {load.requests_waiting:g} waiting >= {limits.spill_when_waiting_gte}; use {spill_to}"
    )


def _for_the_agent(policy: Policy, chosen: str, features: Features, ctx: Context, trail: list[str]) -> str:
    """What the agent's session asks for: its loop or spike flags' redirect, and its own compaction request the
    largest window."""
    if ctx.agent is not None:
        chosen = _redirect(policy, ctx.agent, chosen, trail)
    asker = compaction_asker(features.last_user_text)
    return chosen if asker is None else _largest_window(policy, chosen, features, ctx, trail, asker)


def _largest_window(policy: Policy, chosen: str, features: Features, ctx: Context, trail: list[str],
                    asker: str) -> str:
    """An agent's own compaction request: the usable deployment with the largest window (the chosen one on a tie),
    so the session's longest prompt is not refused where a larger window holds it."""
    usable = [n for n in policy.failover_order(chosen) if _exclusion(policy, n, features, ctx) is None]
    if not usable:
        return chosen  # _usable says why none can take it
    largest = max(usable, key=lambda n: (_window_tokens(policy, n, ctx), n == chosen))
    trail.append(f"agent compaction: {asker}'s summary request goes to {largest}, the largest window "
                 f"({_window_tokens(policy, largest, ctx):,} tokens)")
    return largest


def _window_tokens(policy: Policy, name: str, ctx: Context) -> int:
    found = ctx.fits.get(name)
    if found is not None:
        return found.window
    return policy.deployments[name].max_model_len or 0


def _usable(policy: Policy, chosen: str, features: Features, ctx: Context, trail: list[str]) -> tuple[str, ...]:
    """Drop deployments that are unhealthy, too full or too small for the request from the order."""
    kept: list[str] = []
    too_small: list[str] = []
    for name in policy.failover_order(chosen):
        why = _exclusion(policy, name, features, ctx)
        if why is None:
            kept.append(name)
        else:
            if not _fits(policy, name, features, ctx):
                too_small.append(name)
            trail.append(f"skip {name}: {why}")
        if len(kept) == policy.max_attempts:
            break
    if kept:
        return tuple(kept)
    serving = [n for n, dep in policy.deployments.items() if features.endpoint in dep.endpoints]
    if too_small and set(serving or policy.deployments) <= set(too_small):
        raise ContextTooLong(
            f"The prompt (~{features.prompt_tokens} cl100k tokens) and room to answer do not fit any deployment's "
            f"context window ({'; '.join(_window_of(policy, n, ctx) for n in too_small)}). Shorten the prompt "
            "(compact the conversation) or start a new one",
            param="messages",
        )
    raise NoHealthyDeployment("No healthy deployment can serve this request right now; retry shortly")


def _exclusion(policy: Policy, name: str, features: Features, ctx: Context) -> str | None:
    dep = policy.deployments[name]
    load = ctx.load.get(name, NO_LOAD)
    if features.endpoint not in dep.endpoints:
        return f"does not serve {features.endpoint}"
    if ctx.admission is not None and name not in ctx.admission.allowed:
        return "not admitted by the tenant's budget or the request's cost cap"
    if not load.healthy:
        return "unhealthy"
    if not _fits(policy, name, features, ctx):
        found = ctx.fits.get(name)
        return windows.exclusion(name, found) if found is not None else f"context window {dep.max_model_len} too small"
    full = dep.load.skip_when_kv_cache_usage_gte
    if full is not None and load.kv_cache_usage >= full:
        return f"KV cache {load.kv_cache_usage:.0%} full >= {full:.0%}"
    in_flight = ctx.in_flight.get(name, 0)
    if in_flight >= dep.max_in_flight:
        return f"{in_flight} in flight >= max_in_flight {dep.max_in_flight}"
    return None


MIN_ROOM_TOKENS = windows.MIN_ROOM_TOKENS


def _fits(policy: Policy, name: str, features: Features, ctx: Context) -> bool:
    """Whether the deployment's window holds the prompt and some answer. A `max_tokens` above what the window
    leaves is clamped, not refused: vLLM generates at most what is left (coding agents ask for 32,000 with a
    20,000-token prompt in a 32k window, and take a refusal for a failed turn)."""
    found = ctx.fits.get(name)
    if found is not None:
        return found.fits
    limit = policy.deployments[name].max_model_len
    wanted = min(features.max_tokens or 0, MIN_ROOM_TOKENS)
    return limit is None or features.prompt_tokens + wanted <= limit


def _window_of(policy: Policy, name: str, ctx: Context) -> str:
    found = ctx.fits.get(name)
    return found.describe(name) if found is not None else f"{name}: {policy.deployments[name].max_model_len}"


def _clamped(policy: Policy, name: str, features: Features, ctx: Context) -> str | None:
    """The trail's note when the chosen deployment's window leaves less than the call's max_tokens."""
    found = ctx.fits.get(name)
    if found is not None:
        return windows.note(name, found, features)
    limit = policy.deployments[name].max_model_len
    if limit is None or features.max_tokens is None or features.prompt_tokens + features.max_tokens <= limit:
        return None
    return (f"context: max_tokens {features.max_tokens} clamped to the {limit - features.prompt_tokens} tokens "
            f"{name}'s window of {limit} leaves the prompt")


def _first_failure(when: When, features: Features, ctx: Context, explain: bool) -> str | None:
    """None when every condition holds; else the failed condition (with got/wanted when explaining)."""
    for name, wanted in when.conditions:
        ok, got = _holds(name, wanted, features, ctx)
        if not ok:
            return _why(name, wanted, got, ctx) if explain else name
    return None


Test = Callable[[Features, Context], bool]
RuleTests = tuple[tuple[Rule, tuple[tuple[str, Test], ...]], ...]
# Each rule's conditions as tests, made once per loaded policy (keyed by identity, the policy kept so its id is
# not reused): what `_holds` works out from each condition's name and type on every call is decided once.
# Bounded: policies are reloaded and candidate policies built rarely, but without end.
_RULE_TESTS: dict[int, tuple[Policy, RuleTests]] = {}
_RULE_TESTS_MAX = 256


def _rule_tests(policy: Policy) -> RuleTests:
    found = _RULE_TESTS.get(id(policy))
    if found is not None and found[0] is policy:
        return found[1]
    if len(_RULE_TESTS) >= _RULE_TESTS_MAX:
        _RULE_TESTS.clear()
    tests = tuple((rule, tuple((name, _test(name, wanted)) for name, wanted in rule.when.conditions))
                  for rule in policy.rules)
    _RULE_TESTS[id(policy)] = (policy, tests)
    return tests


def _test(name: str, wanted: Any) -> Test:
    """`_holds(name, wanted, ...)[0]` as one closure."""
    if name == "tools" and isinstance(wanted, bool):  # the most common condition: one comparison
        return (lambda features, ctx: features.tools_count > 0) if wanted else (
            lambda features, ctx: features.tools_count == 0)
    if name == "headers" or name == "tools" or name in TRAJECTORY_CONDITIONS:
        return lambda features, ctx: _holds(name, wanted, features, ctx)[0]
    if name in ("tenant", "complexity"):
        context_field = operator.attrgetter(name)
        return _tested(lambda features, ctx: context_field(ctx), wanted)
    feature = operator.attrgetter("requested_model" if name == "model" else name)
    return _tested(lambda features, ctx: feature(features), wanted)


def _tested(got: Callable[[Features, Context], Any], wanted: Any) -> Test:
    """The test of a value against what the condition wants, as `_holds` does it."""
    if isinstance(wanted, Range):
        return lambda features, ctx: (x := got(features, ctx)) is not None and _in_range(float(x), wanted)
    if isinstance(wanted, ComplexityShare):
        return lambda features, ctx: (x := got(features, ctx)) is not None and x >= share_threshold(wanted, ctx)
    if isinstance(wanted, bool):
        return lambda features, ctx: bool(got(features, ctx) == wanted)
    return lambda features, ctx: (x := got(features, ctx)) is not None and _among(str(x), wanted)


def _holds(name: str, wanted: Any, features: Features, ctx: Context) -> tuple[bool, Any]:
    if name == "headers":
        for header, allowed in wanted.items():
            got = ctx.headers.get(header)
            if got is None or not _among(got, allowed):
                return False, (header, got)
        return True, None
    got = _feature(name, features, ctx)
    if isinstance(wanted, Range):
        return got is not None and _in_range(float(got), wanted), got
    if isinstance(wanted, ComplexityShare):
        return got is not None and got >= share_threshold(wanted, ctx), got
    if isinstance(wanted, bool):
        return got == wanted, got
    return got is not None and _among(str(got), wanted), got


def share_threshold(wanted: ComplexityShare, ctx: Context) -> float:
    """The live threshold of the request's route for this share, else the policy's cold-start one."""
    live = ctx.share_thresholds.get(wanted.hq_share)
    if live is not None:
        return live
    assert wanted.threshold is not None  # set at load from the calibration
    return wanted.threshold


def _why(name: str, wanted: Any, got: Any, ctx: Context) -> str:
    if name == "headers":
        header, value = got
        return f"header {header}={value!r}, wants {wanted[header]!r}"
    if isinstance(wanted, ComplexityShare):
        source = "live" if wanted.hq_share in ctx.share_thresholds else "cold-start"
        return (f"{name}={got!r}, wants the top {wanted.hq_share:.0%} of the route's traffic: "
                f">= {share_threshold(wanted, ctx):.4f} ({source} threshold)")
    return f"{name}={got!r}, wants {_show(wanted)}"


def _feature(name: str, features: Features, ctx: Context) -> Any:
    if name == "tools":
        return features.tools_count > 0
    if name == "model":
        return features.requested_model
    if name == "tenant":
        return ctx.tenant
    if name == "complexity":
        return ctx.complexity
    if name in TRAJECTORY_CONDITIONS:
        return _trajectory_feature(name, ctx)
    return getattr(features, name)


def _trajectory_feature(name: str, ctx: Context) -> Any:
    """A step feature of the conversation, or the session's step rate or spend (None: not known)."""
    if name in STEP_FEATURES:
        return None if ctx.step is None else getattr(ctx.step, name)
    if ctx.session is None:
        return None
    return ctx.session.steps_per_min if name == "steps_per_min" else ctx.session.cost_usd


def _among(got: str, allowed: str | list[str]) -> bool:
    return got == allowed if isinstance(allowed, str) else got in allowed


def _in_range(x: float, r: Range) -> bool:
    return (
        (r.gt is None or x > r.gt)
        and (r.gte is None or x >= r.gte)
        and (r.lt is None or x < r.lt)
        and (r.lte is None or x <= r.lte)
        and (r.eq is None or x == r.eq)
    )


def _show(wanted: Any) -> str:
    if isinstance(wanted, Range):
        return " and ".join(f"{k} {v:g}" for k, v in wanted.model_dump().items() if v is not None)
    return repr(wanted)


def needs_complexity(policy: Policy) -> bool:
    """Whether any rule reads the classifier score (so the hot path can skip scoring otherwise)."""
    return policy.reads_complexity
