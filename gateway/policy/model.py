"""The routing policy: frozen pydantic models of the YAML file, loading with located errors, JSON Schema."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from pydantic import (
    Field,
    PlainSerializer,
    PlainValidator,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from gateway.apis.usage import Usage
from gateway.context.eviction import EvictRule
from gateway.context.masking import MaskRule
from gateway.frozen import Frozen
from gateway.policy.agents import AgentsPolicy
from gateway.policy.compaction import CompactionPolicy
from gateway.policy.context import ContextPolicy, Retrieve
from gateway.policy.switch import DEFAULT_RULE, SwitchPolicy
from gateway.policy.tenancy import AuthPolicy, SessionPolicy, StorePolicy, TenantPolicy, find_tenant
from gateway.rollout import spec as rollout_spec
from gateway.rollout.labels import LabelsSpec
from gateway.rollout.spec import RolloutSpec, ShadowSpec

if TYPE_CHECKING:
    from gateway.classifier.scoring import Classifier

ENDPOINTS = ("chat", "completions", "embeddings", "responses", "messages")
Endpoint = Literal["chat", "completions", "embeddings", "responses", "messages"]



# A cached input token's price as a fraction of an input token's, when a deployment names no cached price:
# what hosted APIs charge for a cache read; self-hosted, a cached token's prefill costs almost nothing.
CACHED_INPUT_FRACTION = 0.1


class Price(Frozen):
    """A deployment's price per million tokens: input, cached input (the prompt's prefix the deployment's prefix
    cache held, as its usage reports it) and output."""

    input_per_mtok_usd: float = Field(0.0, ge=0)
    output_per_mtok_usd: float = Field(0.0, ge=0)
    cached_input_per_mtok_usd: float | None = Field(
        None, ge=0, description="price of a cached input token; default: cached_input_fraction of the input price")
    cached_input_fraction: float = Field(
        CACHED_INPUT_FRACTION, ge=0, le=1,
        description="a cached input token's price as a fraction of the input price, when no cached price is given")

    @model_validator(mode="after")
    def _cached_within_input(self) -> Price:
        cached = self.cached_input_per_mtok_usd
        if cached is not None and "cached_input_fraction" in self.model_fields_set:
            raise ValueError("give cached_input_per_mtok_usd or cached_input_fraction, not both")
        if cached is not None and cached > self.input_per_mtok_usd:
            raise ValueError(f"cached_input_per_mtok_usd {cached} is above input_per_mtok_usd "
                             f"{self.input_per_mtok_usd}: a cached token never costs more than a new one")
        return self

    @property
    def cached_per_mtok_usd(self) -> float:
        """The price of a cached input token: the one given, else the fraction of the input price."""
        given = self.cached_input_per_mtok_usd
        return given if given is not None else self.input_per_mtok_usd * self.cached_input_fraction

    def cost_usd(self, input_tokens: int, output_tokens: int, *, cached_tokens: int) -> float:
        """The cost of a call that read `input_tokens` (of which `cached_tokens` came from the prefix cache: 0
        when not known, which prices every input token as new) and generated `output_tokens`."""
        cached = min(max(cached_tokens, 0), input_tokens)
        return ((input_tokens - cached) * self.input_per_mtok_usd + cached * self.cached_per_mtok_usd
                + output_tokens * self.output_per_mtok_usd) / 1e6

    def cost_usd_of(self, usage: Usage) -> float:
        """What a call's usage costs: its cached prompt tokens at the cached input price."""
        return self.cost_usd(usage.prompt_tokens, usage.completion_tokens, cached_tokens=usage.cached_tokens)


class Timeouts(Frozen):
    connect_s: float = Field(2.0, gt=0)
    # Longest silence from the deployment: waiting for the response (a non-streamed one arrives only
    # when generation ends) and between two streamed chunks.
    read_s: float = Field(120.0, gt=0)
    total_s: float = Field(600.0, gt=0)


class Health(Frozen):
    path: str = "/health"
    interval_s: float = Field(5.0, gt=0)
    timeout_s: float = Field(2.0, gt=0)
    eject_after_failures: int = Field(3, ge=1)
    cooldown_s: float = Field(10.0, ge=0)


class LoadLimits(Frozen):
    """Load-aware routing: spill a deep queue elsewhere, skip a deployment whose KV cache is nearly full."""

    spill_when_waiting_gte: int | None = Field(None, ge=1)
    spill_to: str | None = None
    skip_when_kv_cache_usage_gte: float | None = Field(None, gt=0, le=1)
    metrics_path: str = "/metrics"
    scrape_interval_s: float = Field(1.0, gt=0)


class Deployment(Frozen):
    url: str
    served_model: str
    endpoints: tuple[Endpoint, ...] = ("chat", "completions", "responses", "messages")  # what vLLM serves
    price: Price = Price()
    timeouts: Timeouts = Timeouts()
    max_in_flight: int = Field(256, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    # The worst-case completion size when a request gives no max_tokens; with budgets, also sent as its cap.
    default_max_tokens: int = Field(1024, ge=1)
    health: Health = Health()
    load: LoadLimits = LoadLimits()

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"must start with http:// or https://, got {url!r}")
        return url.rstrip("/")


class ResumePolicy(Frozen):
    """A stream that breaks after its first byte is finished by the next deployment in the failover order: it is
    sent the request and the answer so far as the start of the answer to continue, and the client's stream goes
    on as one answer. `max`: resumes one request may make (each break after a resume is one more)."""

    enabled: bool = True
    max: int = Field(1, ge=1, le=4, description="resumes one request may make")


class ClientModel(Frozen):
    """A model name clients may ask for: `route: rules` (auto) or `pin: DEPLOYMENT`."""

    route: Literal["rules"] | None = None
    pin: str | None = None
    description: str = ""
    resume: ResumePolicy | None = None  # this route's own; default: the policy's
    context: ContextPolicy | None = None  # this route's own context rules; default: the policy's

    @model_validator(mode="after")
    def _exactly_one(self) -> ClientModel:
        if (self.route is None) == (self.pin is None):
            raise ValueError("give exactly one of `route: rules` or `pin: DEPLOYMENT`")
        return self


class Range(Frozen):
    """A numeric comparison; every bound given must hold."""

    gt: float | None = None
    gte: float | None = None
    lt: float | None = None
    lte: float | None = None
    eq: float | None = None

    @model_validator(mode="after")
    def _some_bound(self) -> Range:
        if all(v is None for v in (self.gt, self.gte, self.lt, self.lte, self.eq)):
            raise ValueError("give at least one of gt, gte, lt, lte, eq")
        return self


StrOrList = str | list[str]


class ComplexityShare(Frozen):
    """Send the top `hq_share` of the route's live traffic by classifier score, whatever its mix: the
    threshold follows the score quantile of the route's last `window` calls (shared across replicas when
    a store is configured); the calibration file only gives the threshold until enough calls were seen."""

    hq_share: float = Field(gt=0, lt=1)
    window: int = Field(1000, ge=50, le=100_000, description="recent calls of the route the threshold follows")
    calibration: str | None = None  # relative to the policy file; default: the packaged calibration
    threshold: float | None = Field(None, description="the cold-start threshold; default: from the calibration")


def _cold_threshold(share: ComplexityShare, base_dir: Path | None) -> ComplexityShare:
    from gateway.classifier.scoring import Calibration, ModelFileError

    if share.threshold is not None:
        return share
    try:
        if share.calibration is None:
            calibration = Calibration.default()
        else:
            path = Path(share.calibration)
            calibration = Calibration.load(path if path.is_absolute() or base_dir is None else base_dir / path)
    except (OSError, ModelFileError) as exc:
        raise ValueError(f"calibration {share.calibration or '(packaged default)'}: {exc}") from exc
    return share.model_copy(update={"threshold": calibration.threshold_for_share(share.hq_share)})


TRAJECTORY_CONDITIONS = frozenset({"turn", "step", "tool_error", "repeated_calls", "steps_per_min",
                                   "session_cost_usd"})


class When(Frozen):
    """Conditions over request features; all given ones must hold (an empty `when` always matches)."""

    endpoint: Endpoint | None = None
    model: StrOrList | None = None
    tenant: StrOrList | None = None
    prompt_tokens: Range | None = None
    message_count: Range | None = None
    tool_result_turns: Range | None = None
    max_tokens: Range | None = None
    complexity: Range | ComplexityShare | None = None
    tools: bool | None = None
    stream: bool | None = None
    has_code: bool | None = None
    has_math: bool | None = None
    response_format: StrOrList | None = None
    headers: dict[str, StrOrList] | None = None
    # Where the call stands in its agent loop (gateway/agents/steps.py) and its session (the store's count):
    turn: list[Literal["user", "tool_result", "other"]] | Literal["user", "tool_result", "other"] | None = None
    step: Range | None = None
    tool_error: bool | None = None
    repeated_calls: Range | None = None
    steps_per_min: Range | None = None
    session_cost_usd: Range | None = None

    @functools.cached_property
    def conditions(self) -> tuple[tuple[str, Any], ...]:
        """The given conditions only, computed once: the hot path must not walk every field per request."""
        return tuple((name, value) for name, value in self if value is not None)

    @functools.cached_property
    def reads_trajectory(self) -> bool:
        """Whether a condition reads the agent's trajectory (such a rule wins over the session's pin)."""
        return any(name in TRAJECTORY_CONDITIONS for name, _ in self.conditions)

    @field_validator("complexity")
    @classmethod
    def _share_to_threshold(
        cls, value: Range | ComplexityShare | None, info: ValidationInfo
    ) -> Range | ComplexityShare | None:
        """Read a target share's cold-start threshold from its calibration once, at load time."""
        if not isinstance(value, ComplexityShare):
            return value
        base_dir = (info.context or {}).get("base_dir")
        return _cold_threshold(value, base_dir)

    @field_validator("headers")
    @classmethod
    def _lowercase_names(cls, headers: dict[str, StrOrList] | None) -> dict[str, StrOrList] | None:
        return None if headers is None else {k.lower(): v for k, v in headers.items()}


class ModelFile:
    """A classifier model file a policy names, loaded (plain JSON, never unpickled) once when the policy loads."""

    __slots__ = ("model", "path")

    def __init__(self, path: str, model: Classifier) -> None:
        self.path, self.model = path, model

    def __repr__(self) -> str:
        return f"ModelFile({self.path!r})"


def _model_file(value: Any, info: ValidationInfo) -> ModelFile:
    from gateway.classifier.scoring import Classifier, ModelFileError

    if isinstance(value, ModelFile):  # a candidate policy built from the live one's sections: already loaded
        return value
    if not isinstance(value, str) or not value:
        raise ValueError("must be the path of a classifier model JSON file (from `classifier train`)")
    base_dir = (info.context or {}).get("base_dir")
    path = Path(value)
    resolved = path if path.is_absolute() or base_dir is None else Path(base_dir) / path
    try:
        return ModelFile(str(resolved), Classifier.load(resolved))
    except ModelFileError as exc:
        raise ValueError(str(exc)) from exc


ClassifierFile = Annotated[
    ModelFile,
    PlainValidator(_model_file),
    PlainSerializer(lambda found: found.path, when_used="json"),
    WithJsonSchema({"type": "string", "description": "a classifier model JSON file, relative to the policy"}),
]


class Rule(Frozen):
    name: str = Field(min_length=1)
    when: When = When()
    use: str
    # A pinned model (`hq`, `fast`) ignores rules unless the rule says it overrides pins.
    override_pin: bool = False


class CandidatePolicy(Frozen):
    """A routing policy to roll out or shadow (`policy:NAME`): the live one with these sections replaced."""

    rules: list[Rule] | None = None
    default: str | None = None
    fallback: list[str] | None = None
    classifier: ClassifierFile | None = None  # its own complexity scores (default: the live policy's model)
    # its own context rules, in place of the policy's own section (routes and tenants with their own keep them);
    # on a rollout's candidate arm the deployment reads the prompt as they make it
    context: ContextPolicy | None = None


class PolicyShadow(Frozen):
    """Evaluate a candidate policy on live traffic; record its decision where it disagrees, call nothing."""

    candidate: str = Field(description="a name declared under `policies:`")
    percent: float = Field(100.0, gt=0, le=100)


MEMO_KEYS = 4096  # (route, tenant) pairs whose resolved rules a policy remembers
LIVE_POLICY = "live"  # the target name of the live policy itself (`policy:live`), for `auto`-like routes


class Policy(Frozen):
    version: Literal[1] = 1
    deployments: dict[str, Deployment]
    models: dict[str, ClientModel]
    rules: list[Rule] = []
    default: str
    fallback: list[str] = []
    max_attempts: int = Field(2, ge=1, le=5)
    resume: ResumePolicy = ResumePolicy()
    policies: dict[str, CandidatePolicy] = {}
    rollouts: list[RolloutSpec] = []
    shadows: list[ShadowSpec] = []
    policy_shadow: PolicyShadow | None = None
    labels: LabelsSpec | None = None
    # The model complexity rules read, relative to the policy (default: AGENT_GATEWAY_CLASSIFIER_MODEL or the
    # packaged one); a candidate under `policies:` may name its own.
    classifier: ClassifierFile | None = None
    tenants: list[TenantPolicy] = []
    sessions: SessionPolicy = SessionPolicy()
    store: StorePolicy = StorePolicy()
    auth: AuthPolicy = AuthPolicy()
    agents: AgentsPolicy = AgentsPolicy()
    # A switch's price in the decision (policy/switch.py); None: every step goes where its rule says.
    switch: SwitchPolicy | None = None
    # What the gateway does to a conversation's context (policy/context.py); off unless given.
    context: ContextPolicy = ContextPolicy()
    compaction: CompactionPolicy = CompactionPolicy()

    @model_validator(mode="after")
    def _references_exist(self) -> Policy:
        for problem in self._dangling_references():
            raise ValueError(problem)
        return self

    def _dangling_references(self) -> Iterator[str]:
        known = self.deployments
        if not known:
            yield "deployments: at least one deployment is needed"
        if self.default not in known:
            yield f"default: unknown deployment {self.default!r} (known: {sorted(known)})"
        for name in self.fallback:
            if name not in known:
                yield f"fallback: unknown deployment {name!r} (known: {sorted(known)})"
        for model_name, model in self.models.items():
            if model.pin is not None and model.pin not in known:
                yield f"models.{model_name}.pin: unknown deployment {model.pin!r} (known: {sorted(known)})"
        seen: set[str] = set()
        for i, rule in enumerate(self.rules):
            if rule.use not in known:
                yield f"rules[{i}].use: unknown deployment {rule.use!r} (known: {sorted(known)})"
            if rule.name in seen:
                yield f"rules[{i}].name: duplicate rule name {rule.name!r}"
            seen.add(rule.name)
        yield from self._load_problems()
        yield from self._experiment_problems()
        yield from self._tenancy_problems()
        yield from self._switch_problems()

    def _load_problems(self) -> Iterator[str]:
        for name, dep in self.deployments.items():
            if dep.load.spill_to is not None and dep.load.spill_to not in self.deployments:
                yield f"deployments.{name}.load.spill_to: unknown deployment {dep.load.spill_to!r}"

    def _tenancy_problems(self) -> Iterator[str]:
        known = sorted(self.deployments)
        seen: set[str] = set()
        for i, tenant in enumerate(self.tenants):
            if tenant.name in seen:
                yield f"tenants[{i}].name: duplicate tenant {tenant.name!r}"
            seen.add(tenant.name)
            steer = tenant.above_soft
            soft = any(b.soft_usd is not None or b.soft_tokens is not None for b in tenant.budgets)
            # the default `fast` only matters when a soft limit can steer to it
            named = "route_to" in steer.model_fields_set or soft
            if steer.route_to is not None and steer.route_to not in known and named:
                yield f"tenants[{i}].above_soft.route_to: unknown deployment {steer.route_to!r} " \
                      f"(known: {known})"
            for name in steer.refuse:
                if name not in known:
                    yield f"tenants[{i}].above_soft.refuse: unknown deployment {name!r} (known: {known})"
        target = self.sessions.tight_loop_route_to
        if self.sessions.tight_loop_steps_per_min is not None and target not in known:
            yield f"sessions.tight_loop_route_to: unknown deployment {target!r} (known: {known})"
        for field, name in self.agents.targets():
            if name not in known:
                yield f"{field}: unknown deployment {name!r} (known: {known})"
        if self.compaction.deployment is not None and self.compaction.deployment not in known:
            yield f"compaction.deployment: unknown deployment {self.compaction.deployment!r} (known: {known})"

    def _switch_problems(self) -> Iterator[str]:
        if self.switch is None:
            return
        for name, ms in self.switch.prefill_ms_per_1k_tokens.items():
            if name not in self.deployments:
                yield f"switch.prefill_ms_per_1k_tokens.{name}: unknown deployment {name!r} " \
                      f"(known: {sorted(self.deployments)})"
            elif ms < 0:
                yield f"switch.prefill_ms_per_1k_tokens.{name}: must be >= 0, got {ms}"
        rules = {rule.name for rule in self.rules} | {DEFAULT_RULE}
        for name, ms in self.switch.worth_ms.items():
            if name not in rules:
                yield f"switch.worth_ms.{name}: unknown rule {name!r} (rules: {sorted(rules)})"
            elif ms < 0:
                yield f"switch.worth_ms.{name}: must be >= 0, got {ms}"

    def _experiment_problems(self) -> Iterator[str]:
        known = self.deployments
        for name, cand in self.policies.items():
            used = [*(r.use for r in cand.rules or ()), *([cand.default] if cand.default else ()),
                    *(cand.fallback or ())]
            for dep in used:
                if dep not in known:
                    yield f"policies.{name}: unknown deployment {dep!r} (known: {sorted(known)})"
        if self.policy_shadow is not None and self.policy_shadow.candidate not in self.policies:
            yield (f"policy_shadow.candidate: unknown policy {self.policy_shadow.candidate!r} "
                   f"(declared under policies: {sorted(self.policies)})")
        stable_of = {name: f"deployment:{m.pin}" if m.pin else f"policy:{LIVE_POLICY}"
                     for name, m in self.models.items()}
        yield from rollout_spec.problems(self.rollouts, self.shadows, stable_of=stable_of,
                                         deployments=known, policies=self.policies)
        yield from self._labels_problems()

    def _labels_problems(self) -> Iterator[str]:
        labels = self.labels
        if labels is None:
            return
        named = {"strong": labels.strong, "weak": labels.weak,
                 "judge.deployment": labels.judge.deployment if labels.judge else None}
        for where, name in named.items():
            if name is not None and name not in self.deployments:
                yield f"labels.{where}: unknown deployment {name!r} (known: {sorted(self.deployments)})"
        if labels.weak is not None and labels.weak == labels.strong:
            yield f"labels.weak: {labels.weak!r} is also the strong deployment"

    def classifier_or(self, default: Classifier) -> Classifier:
        """The model this policy's complexity rules read: its own `classifier`, else the process's."""
        return self.classifier.model if self.classifier is not None else default

    @functools.cached_property
    def experimental(self) -> bool:
        """Whether any rollout or shadow is declared (the request path skips that machinery otherwise)."""
        return bool(self.rollouts or self.shadows or self.policy_shadow)

    @functools.cached_property
    def accounted(self) -> bool:
        """Whether tenants, keys or session rules are configured (else the request path skips the store)."""
        s = self.sessions
        sessions_used = s.pin or s.tight_loop_steps_per_min is not None or s.cost_cap_usd is not None
        return bool(self.tenants) or self.auth.enabled or sessions_used

    @functools.cached_property
    def read_headers(self) -> frozenset[str]:
        """The request headers (lower-case) its rules, its candidate policies' rules and its rollout keys read."""
        rules = [*self.rules, *(r for cand in self.policies.values() for r in cand.rules or ())]
        names = {name for rule in rules for name in (rule.when.headers or {})}
        names.update(source.removeprefix("header:").lower() for spec in self.rollouts for source in spec.key
                     if source.startswith("header:"))
        return frozenset(names)

    def candidate_policy(self, name: str) -> Policy:
        """The declared candidate `name` as a whole Policy (cached: policies are swapped whole on reload)."""
        found = self._candidate_policies.get(name)
        if found is None:
            cand = self.policies[name]
            live = self.model_dump(exclude={"rollouts", "shadows", "policy_shadow"})
            found = Policy.model_validate({**live, **cand.model_dump(exclude_none=True)})
            self._candidate_policies[name] = found
        return found

    @functools.cached_property
    def _candidate_policies(self) -> dict[str, Policy]:
        return {}

    def resume_for(self, requested_model: str) -> ResumePolicy:
        """The resume rule of the route a call asked for: its own, else the policy's."""
        route = self.models.get(requested_model)
        return route.resume if route is not None and route.resume is not None else self.resume

    def mask_rule(self, requested_model: str, tenant: str | None) -> MaskRule | None:
        """The masking rule of a call: its tenant's own, else its route's, else the policy's (None: off)."""
        rules = self.context_of(requested_model, tenant)
        return rules.mask_tool_outputs.rule() if rules.mask_tool_outputs is not None else None

    def evict_rule(self, requested_model: str, tenant: str | None) -> EvictRule | None:
        """The call's rule for summarizing old turns, chosen as `mask_rule` is (None: off)."""
        rules = self.context_of(requested_model, tenant)
        return rules.summarize_old_turns.rule() if rules.summarize_old_turns is not None else None

    def retrieve_rule(self, requested_model: str, tenant: str | None) -> Retrieve | None:
        """The call's retrieval section, chosen as `mask_rule` is (None: off)."""
        return self.context_of(requested_model, tenant).retrieve

    def context_of(self, requested_model: str, tenant: str | None) -> ContextPolicy:
        """The call's context rules: its tenant's own section, else its route's, else the policy's."""
        key = (requested_model, tenant)
        if key in self._context_sections:
            return self._context_sections[key]
        found = find_tenant(self.tenants, tenant) if tenant is not None else None
        route = self.models.get(requested_model)
        chosen = next((c for c in (found.context if found else None, route.context if route else None)
                       if c is not None), self.context)
        if len(self._context_sections) < MEMO_KEYS:  # routes x tenants; a flood of unknown names is not kept
            self._context_sections[key] = chosen
        return chosen

    @functools.cached_property
    def masks_context(self) -> bool:
        """Whether any route or tenant masks tool outputs (else the request path skips it)."""
        return any(s.mask_tool_outputs is not None for s in self._context_rules)

    @functools.cached_property
    def summarizes_context(self) -> bool:
        """Whether any route or tenant summarizes old turns (else the request path skips it)."""
        return any(s.summarize_old_turns is not None for s in self._context_rules)

    @functools.cached_property
    def manages_context(self) -> bool:
        """Whether any context rule is on, in this policy or a candidate it declares."""
        candidates = any(p.context is not None for p in self.policies.values())
        return candidates or self.masks_context or self.summarizes_context or self.retrieves_context

    @functools.cached_property
    def retrieves_context(self) -> bool:
        """Whether any route or tenant puts retrieved pieces back (else the request path skips it)."""
        return any(s.retrieve is not None for s in self._context_rules)

    @property
    def _context_rules(self) -> list[ContextPolicy]:
        sections = [self.context, *(m.context for m in self.models.values()), *(t.context for t in self.tenants)]
        return [s for s in sections if s is not None]

    @functools.cached_property
    def _context_sections(self) -> dict[tuple[str, str | None], ContextPolicy]:
        return {}

    def failover_order(self, first: str) -> tuple[str, ...]:
        """Deployments to try for a request that prefers `first`: it, then the fallback list, then the rest
        but those only experiments reach (see experiment_only).

        The caller keeps the first max_attempts that are usable, so excluded ones do not use up attempts.
        """
        order = self._failover_orders.get(first)
        if order is None:
            rest = (name for name in self.deployments if name not in self.experiment_only)
            order = tuple(dict.fromkeys([first, *self.fallback, *rest]))
            self._failover_orders[first] = order
        return order

    @functools.cached_property
    def experiment_only(self) -> frozenset[str]:
        """Deployments that only experiments reach: a rollout's candidate, a shadow's target, the labels'
        judge, a deployment only a candidate policy uses. Failover does not send live traffic to them (an
        aborted candidate or the judge would answer clients) unless the fallback list names them."""
        routed = {self.default, *self.fallback, *(r.use for r in self.rules),
                  *(m.pin for m in self.models.values() if m.pin is not None),
                  *(d.load.spill_to for d in self.deployments.values() if d.load.spill_to is not None),
                  *(t.above_soft.route_to for t in self.tenants if t.above_soft.route_to is not None),
                  self.sessions.tight_loop_route_to, *(name for _, name in self.agents.targets())}
        targets = [*(r.candidate for r in self.rollouts), *(s.target for s in self.shadows)]
        reached = {t.removeprefix("deployment:") for t in targets if t.startswith("deployment:")}
        for cand in self.policies.values():
            reached.update(r.use for r in cand.rules or ())
            reached.update([*([cand.default] if cand.default else ()), *(cand.fallback or ())])
        if self.labels is not None and self.labels.judge is not None:
            reached.add(self.labels.judge.deployment)
        return frozenset(reached - routed)

    @functools.cached_property
    def _failover_orders(self) -> dict[str, tuple[str, ...]]:
        return {}

    @functools.cached_property
    def reads_complexity(self) -> bool:
        """Whether any rule reads the classifier score (so the hot path can skip scoring otherwise)."""
        return any(rule.when.complexity is not None for rule in self.rules)

    @functools.cached_property
    def reads_steps(self) -> bool:
        """Whether any rule reads where a call stands in its agent loop (else the body is not walked for it)."""
        return any(rule.when.reads_trajectory for rule in self.rules)

    @functools.cached_property
    def share_windows(self) -> dict[float, int]:
        """Each target HQ share its rules ask for (the live and candidate policies'), with its window."""
        rules = [*self.rules, *(r for cand in self.policies.values() for r in cand.rules or ())]
        found: dict[float, int] = {}
        for rule in rules:
            share = rule.when.complexity
            if isinstance(share, ComplexityShare):
                found[share.hq_share] = max(found.get(share.hq_share, 0), share.window)
        return found

    @functools.cached_property
    def share_cold_thresholds(self) -> dict[float, float]:
        """Each target share's cold-start threshold (the calibration's), the first rule's where they differ."""
        rules = [*self.rules, *(r for cand in self.policies.values() for r in cand.rules or ())]
        found: dict[float, float] = {}
        for rule in rules:
            share = rule.when.complexity
            if isinstance(share, ComplexityShare) and share.threshold is not None:
                found.setdefault(share.hq_share, share.threshold)
        return found

    @functools.cached_property
    def rule_routes(self) -> frozenset[str]:
        """The client models routed by the rules (their traffic is what a share rule's quantile follows)."""
        return frozenset(name for name, model in self.models.items() if model.pin is None)


class PolicyError(Exception):
    """A policy file that cannot be used; `problems` are one line each: file:line: field: message (value)."""

    def __init__(self, path: str, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.path = path
        self.problems = problems


def load(path: str | Path) -> Policy:
    """Read, parse and validate a policy file; raise PolicyError listing every problem found."""
    path = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(path, [f"{path}: cannot read: {exc.strerror}"]) from exc
    return parse(text, path)


def parse(text: str, path: str = "<policy>") -> Policy:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        raise PolicyError(path, [f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}"]) from exc
    if not isinstance(data, dict):
        raise PolicyError(path, [f"{path}: the policy must be a YAML mapping, got {type(data).__name__}"])
    try:
        return Policy.model_validate(data, context={"base_dir": Path(path).parent})
    except ValidationError as exc:
        raise PolicyError(path, [_locate(path, node, err) for err in exc.errors()]) from exc


def _locate(path: str, root: yaml.Node | None, err: Mapping[str, Any]) -> str:
    loc = [part for part in err["loc"] if not (isinstance(part, str) and part.startswith("function-"))]
    message = str(err["msg"]).removeprefix("Value error, ")
    if not loc:  # a whole-policy check names its field at the start of the message: locate that
        loc = _named_loc(message)
        message = message.split(": ", 1)[1] if loc else message
    field = ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in loc).replace(".[", "[")
    line = _line_of(root, loc)
    where = f"{path}:{line}" if line else path
    value = err.get("input")
    shown = "" if isinstance(value, dict | list) or value is None else f" (value: {value!r})"
    return f"{where}: {field or '<top>'}: {message}{shown}"


def _named_loc(message: str) -> list[Any]:
    """`rollouts[0].route: ...` -> ["rollouts", 0, "route"]; [] when the message names no field."""
    head = message.split(":", 1)[0]
    if " " in head or head == message:
        return []
    return [int(p) if p.isdigit() else p for p in re.split(r"[.\[\]]+", head) if p]


def _line_of(node: yaml.Node | None, loc: list[Any]) -> int | None:
    """The 1-based line of the deepest YAML node that the pydantic location reaches."""
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        child = _child(node, part)
        if child is None:
            break
        node, line = child, child.start_mark.line + 1
    return line


def _child(node: yaml.Node | None, part: Any) -> yaml.Node | None:
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if key.value == str(part):
                return value  # type: ignore[no-any-return]  # PyYAML's node values are untyped
    if isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
        return node.value[part]  # type: ignore[no-any-return]
    return None


def json_schema() -> str:
    """The JSON Schema of the policy file, for editors (policies/policy.schema.json)."""
    return json.dumps(Policy.model_json_schema(), indent=2, sort_keys=True) + "\n"
