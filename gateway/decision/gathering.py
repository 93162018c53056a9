"""The one gathering of a decision's inputs besides the call, for the live gateway and every offline tool alike.

An explanation of a decision the gateway did not make is worse than none: the live handler, `POST
/admin/explain`, `policy explain` and `policy simulate` all build their Context here, and differ only in where
the score, the share thresholds and the deployments' and tenant's state come from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from gateway.agents.loops import AgentVerdict
from gateway.decision.admission import Admission, SessionState
from gateway.decision.call import Call
from gateway.decision.routing import Context, DeploymentLoad
from gateway.decision.switch import SessionCache
from gateway.decision.windows import Count, fits_of
from gateway.features import Features
from gateway.policy.model import Policy


class Scoring(Protocol):
    """Where the complexity score and the route's live share thresholds come from."""

    def score(self, policy: Policy, features: Features) -> float | None:
        """The complexity score; None when there is none to be had (a log line that kept no score)."""
        ...

    def thresholds(self, policy: Policy, route: str, complexity: float) -> Mapping[float, float]:
        """Target share -> live threshold; {} means every share uses its cold-start threshold."""
        ...


@dataclass(slots=True)
class Surroundings:
    """The state around a call that the decision reads: the deployments', the tenant's and the session's."""

    load: Mapping[str, DeploymentLoad] = field(default_factory=dict)
    in_flight: Mapping[str, int] = field(default_factory=dict)
    admission: Admission | None = None  # the budget and session verdict; None: no limits apply
    session: SessionState | None = None
    agent: AgentVerdict | None = None  # what the session's loop or spike flags ask of this call
    cache: SessionCache | None = None  # what each deployment's prefix cache holds of the prompt (context/prefix.py)
    windows: Mapping[str, int] = field(default_factory=dict)  # each deployment's max_model_len, as it reports it
    counts: Mapping[str, Count] = field(default_factory=dict)  # the prompt in a deployment's own tokens


def gather(call: Call, scoring: Scoring, around: Surroundings) -> Context:
    """The decision's Context for this call: scored only when a rule reads the score."""
    policy, features = call.policy, call.features
    complexity = None
    thresholds: Mapping[float, float] = {}
    if policy.reads_complexity:
        complexity = scoring.score(policy, features)
        route = features.requested_model
        if complexity is not None and policy.share_windows and route in policy.rule_routes:
            thresholds = scoring.thresholds(policy, route, complexity)
    fits = fits_of(policy, features, around.windows, around.counts)
    # Positional, in Context's field order (headers, tenant, complexity, load, in_flight, admission, session,
    # share_thresholds, step, agent, cache, fits): a class called with keywords gets them as a dict built per
    # call.
    return Context(read_headers(policy, call.headers), call.tenant, complexity, around.load, around.in_flight,
                   around.admission, around.session, thresholds, call.step, around.agent, around.cache, fits)


def read_headers(policy: Policy, headers: Mapping[str, str]) -> dict[str, str]:
    """The request headers the policy reads (its rules', its candidate policies' and its rollout keys'): the
    decision reads no other, and a Context that is kept (the explain memory) must not hold a request's own
    headers, up to 128 lines of 8 KiB each."""
    return {name: value for name in policy.read_headers if (value := headers.get(name)) is not None}


class Model(Protocol):
    """A complexity classifier, as far as the decision reads it."""

    def score(self, features: Features) -> float: ...

    def explain(self, features: Features, top: int = 5) -> list[tuple[str, float]]: ...


class ColdStart:
    """Offline scoring: the policy's own classifier, else `default`; every share at its cold-start threshold
    (an offline tool has no live window to read)."""

    def __init__(self, default: Callable[[], Model]) -> None:
        self._default = default

    def model(self, policy: Policy) -> Model:
        return policy.classifier.model if policy.classifier is not None else self._default()

    def score(self, policy: Policy, features: Features) -> float:
        return self.model(policy).score(features)

    def thresholds(self, policy: Policy, route: str, complexity: float) -> Mapping[float, float]:
        return {}


class Logged:
    """A logged request's score, or the policy's own classifier's where it names one and the log kept the prompt."""

    def __init__(self, complexity: float | None) -> None:
        self._complexity = complexity

    def score(self, policy: Policy, features: Features) -> float | None:
        if policy.classifier is not None and features.last_user_text:
            return policy.classifier.model.score(features)
        return self._complexity

    def thresholds(self, policy: Policy, route: str, complexity: float) -> Mapping[float, float]:
        return {}
