"""Span attribute names (GenAI semantic conventions) and every Prometheus series the gateway exports."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

# GenAI semantic-convention attribute names (opentelemetry semconv, gen_ai.*).
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_PROVIDER = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_CONVERSATION_ID = "gen_ai.conversation.id"
GEN_AI_TOOL_NAME = "gen_ai.tool.name"
GEN_AI_TOOL_CALL_ID = "gen_ai.tool.call.id"
GEN_AI_TOOL_TYPE = "gen_ai.tool.type"
GEN_AI_TOOL_CALL_ARGUMENTS = "gen_ai.tool.call.arguments"  # only when prompts are kept
GEN_AI_TOOL_CALL_RESULT = "gen_ai.tool.call.result"  # only when prompts are kept
ERROR_TYPE = "error.type"
# The gateway's own attributes.
DEPLOYMENT = "gateway.deployment"
RULE = "gateway.rule"
REASONS = "gateway.reasons"
ATTEMPTS = "gateway.attempts"
TTFT_MS = "gateway.ttft_ms"
COMPLEXITY = "gateway.complexity"
REQUEST_ID = "gateway.request_id"
CLIENT_REQUEST_ID = "gateway.client_request_id"
AGENT_STEP = "gateway.agent.step"
AGENT_TOOL_CALLS = "gateway.agent.tool_calls"  # names of the tool calls the model asked for
AGENT_FLAGS = "gateway.agent.flags"
AGENT_ACTION = "gateway.agent.action"
AGENT_FLAG_EVENT = "gateway.agent.flag"  # a span event: a loop or spike flag raised at this step
TOOL_ARGS_DIGEST = "gateway.tool.args_digest"

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


@dataclass(slots=True)
class ScoringCost:
    """Time spent in the classifier, summed in plain attributes (a Counter's lock would cost more than a
    score) and exported at scrape time as gateway_classifier_seconds_total / gateway_classifier_scores_total."""

    seconds: float = 0.0
    scores: int = 0


class _ScoringCollector(Collector):
    def __init__(self, cost: ScoringCost) -> None:
        self.cost = cost

    def collect(self) -> Any:
        yield CounterMetricFamily("gateway_classifier_seconds", "Wall time spent scoring requests (in the event "
                                  "loop, so about its CPU time)", value=self.cost.seconds)
        yield CounterMetricFamily("gateway_classifier_scores", "Requests scored by the classifier",
                                  value=self.cost.scores)


@dataclass(slots=True)
class SpecDecodeCounts:
    """Each speculating deployment's (drafts, draft tokens, accepted tokens) as its vLLM last reported them,
    exported at scrape time as counters: vLLM's own counters since it started, so a restart reads as a
    counter reset, which rate() handles."""

    by_deployment: dict[str, tuple[float, float, float]] = field(default_factory=dict)


SPEC_DECODE_SERIES = (
    ("gateway_deployment_spec_decode_drafts", "Speculative drafts the deployment's proposer made (vLLM's count)"),
    ("gateway_deployment_spec_decode_draft_tokens", "Tokens drafted by the deployment's proposer (vLLM's count)"),
    ("gateway_deployment_spec_decode_accepted_tokens", "Drafted tokens the deployment's model accepted (vLLM's count)"),
)


class _SpecDecodeCollector(Collector):
    def __init__(self, counts: SpecDecodeCounts) -> None:
        self.counts = counts

    def collect(self) -> Any:
        families = [CounterMetricFamily(name, text, labels=["deployment"]) for name, text in SPEC_DECODE_SERIES]
        for deployment, values in sorted(self.counts.by_deployment.items()):
            for family, value in zip(families, values, strict=True):
                family.add_metric([deployment], value)
        yield from families


@dataclass(frozen=True)
class AgentSeries:
    """Agent process metrics per deployment and rollout arm (arm "none" outside rollouts), applied by the
    trajectory flusher in its batches. Ratios in PromQL: steps / sessions (steps per session), cost /
    sessions, session_seconds / sessions (duration), tool_results{outcome="error"} / tool_results
    (tool-call error rate), repeated_tool_calls / steps_with_tool_calls (rework rate)."""

    steps: Counter
    sessions: Counter
    tool_calls: Counter
    steps_with_tool_calls: Counter
    tool_results: Counter
    repeated_tool_calls: Counter
    cost: Counter
    session_seconds: Counter
    flags: Counter
    actions: Counter
    dropped: Counter


def _agent_series(r: CollectorRegistry) -> AgentSeries:
    per = ["deployment", "arm"]
    return AgentSeries(
        steps=Counter("gateway_agent_steps", "Agent steps recorded", per, registry=r),
        sessions=Counter("gateway_agent_sessions", "Agent sessions started (their first step)", per, registry=r),
        tool_calls=Counter("gateway_agent_tool_calls", "Tool calls the model asked for", per, registry=r),
        steps_with_tool_calls=Counter("gateway_agent_steps_with_tool_calls", "Steps that asked for a tool call",
                                      per, registry=r),
        tool_results=Counter("gateway_agent_tool_results", "Tool outputs sent back, by outcome (ok, error)",
                             [*per, "outcome"], registry=r),
        repeated_tool_calls=Counter("gateway_agent_repeated_tool_calls", "Steps asking for a tool call (same "
                                    "name and arguments) the session had already made: rework", per, registry=r),
        cost=Counter("gateway_agent_cost_usd", "Spend of agent steps", per, registry=r),
        session_seconds=Counter("gateway_agent_session_seconds", "Time between a session's first and latest "
                                "steps, summed as it grows", per, registry=r),
        flags=Counter("gateway_agent_flags", "Loop and spike flags raised, by flag and the action the policy "
                      "takes", ["flag", "action"], registry=r),
        actions=Counter("gateway_agent_actions", "Requests escalated, steered or stopped for a session's flag",
                        ["flag", "action"], registry=r),
        dropped=Counter("gateway_agent_steps_dropped", "Steps not recorded (queue full, store unreachable)",
                        ["reason"], registry=r),
    )


@dataclass(frozen=True)
class Metrics:
    """The gateway's Prometheus series, in a registry of its own (one per app)."""

    registry: CollectorRegistry
    requests: Counter
    latency: Histogram
    ttft: Histogram
    tokens: Counter
    failovers: Counter
    policy_reloads: Counter
    policy_valid: Gauge
    deployment_healthy: Gauge
    deployment_waiting: Gauge
    deployment_running: Gauge
    deployment_kv_cache: Gauge
    deployment_spec_acceptance: Gauge
    in_flight: Gauge
    shadow_dropped: Counter
    shadow_sent: Counter
    shadow_pairs: Counter
    rollout_requests: Counter
    rollout_stale: Gauge
    rollout_weight: Gauge
    policy_shadow_decisions: Counter
    labels: Counter
    labels_skipped: Counter
    judge_calls: Counter
    labeller_dropped: Counter
    share_target: Gauge
    share_observed: Gauge
    share_threshold: Gauge
    agents: AgentSeries
    # prometheus_client validates and hashes label values on every .labels() call; the label sets are
    # few, so each child is looked up once and kept.
    request_children: dict[tuple[str, str, str, str], tuple[Any, Any, Any]] = field(default_factory=dict)
    token_children: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    scoring: ScoringCost = field(default_factory=ScoringCost)
    spec_decode: SpecDecodeCounts = field(default_factory=SpecDecodeCounts)

    # Each request's figures wait here and reach the series in batches: prometheus_client takes a lock
    # and scans the buckets per observation, which in place, amid a request, costs ~15 µs per request;
    # applied FOLD_EVERY at a time, with the code warm, about a third of that. A scrape folds first.
    pending: list[tuple[str, str, str, str, float, float | None]] = field(default_factory=list)
    pending_tokens: list[tuple[str, int, int]] = field(default_factory=list)

    def render(self) -> bytes:
        self.fold()
        return generate_latest(self.registry)

    def observe_request(
        self, endpoint: str, deployment: str, rule: str, status: str, elapsed_s: float, ttft_s: float | None
    ) -> None:
        self.pending.append((endpoint, deployment, rule, status, elapsed_s, ttft_s))
        if len(self.pending) >= FOLD_EVERY:
            self.fold()

    def count_tokens(self, deployment: str, input_tokens: int, output_tokens: int) -> None:
        self.pending_tokens.append((deployment, input_tokens, output_tokens))

    def fold(self) -> None:
        """Apply the waiting figures to the Prometheus series."""
        pending = self.pending.copy()
        self.pending.clear()
        for endpoint, deployment, rule, status, elapsed_s, ttft_s in pending:
            children = self._request_children(endpoint, deployment, rule, status)
            children[0].inc()
            children[1].observe(elapsed_s)
            if ttft_s is not None:
                children[2].observe(ttft_s)
        tokens = self.pending_tokens.copy()
        self.pending_tokens.clear()
        for deployment, input_tokens, output_tokens in tokens:
            inputs, outputs = self._token_children(deployment)
            inputs.inc(input_tokens)
            outputs.inc(output_tokens)

    def _request_children(self, endpoint: str, deployment: str, rule: str, status: str) -> tuple[Any, Any, Any]:
        key = (endpoint, deployment, rule, status)
        children = self.request_children.get(key)
        if children is None:
            children = (self.requests.labels(*key), self.latency.labels(endpoint, deployment),
                        self.ttft.labels(deployment))
            self.request_children[key] = children
        return children

    def _token_children(self, deployment: str) -> tuple[Any, Any]:
        children = self.token_children.get(deployment)
        if children is None:
            children = (self.tokens.labels(deployment, "input"), self.tokens.labels(deployment, "output"))
            self.token_children[deployment] = children
        return children


FOLD_EVERY = 256


def make_metrics() -> Metrics:
    r = CollectorRegistry()
    dep = ["deployment"]
    scoring = ScoringCost()
    r.register(_ScoringCollector(scoring))
    spec_decode = SpecDecodeCounts()
    r.register(_SpecDecodeCollector(spec_decode))
    return Metrics(
        scoring=scoring,
        spec_decode=spec_decode,
        registry=r,
        requests=Counter("gateway_requests", "Requests by outcome", ["endpoint", "deployment", "rule", "status"],
                         registry=r),
        latency=Histogram("gateway_request_duration_seconds", "Time to the last byte", ["endpoint", "deployment"],
                          buckets=LATENCY_BUCKETS_S, registry=r),
        ttft=Histogram("gateway_time_to_first_token_seconds", "Time to the first streamed chunk", dep,
                       buckets=LATENCY_BUCKETS_S, registry=r),
        tokens=Counter("gateway_tokens", "Tokens reported by deployments", ["deployment", "direction"], registry=r),
        failovers=Counter("gateway_failovers", "Attempts moved to the next deployment", ["from_deployment", "reason"],
                          registry=r),
        policy_reloads=Counter("gateway_policy_reloads", "Policy reloads by result", ["result"], registry=r),
        policy_valid=Gauge("gateway_policy_last_reload_ok", "1 when the last policy reload succeeded", registry=r),
        deployment_healthy=Gauge("gateway_deployment_healthy", "1 when routable", dep, registry=r),
        deployment_waiting=Gauge("gateway_deployment_requests_waiting", "vLLM queue depth", dep, registry=r),
        deployment_running=Gauge("gateway_deployment_requests_running", "vLLM running requests", dep, registry=r),
        deployment_kv_cache=Gauge("gateway_deployment_kv_cache_usage_ratio", "vLLM KV cache usage", dep, registry=r),
        deployment_spec_acceptance=Gauge("gateway_deployment_spec_decode_acceptance_ratio",
                                         "Accepted / drafted speculative tokens since the deployment started",
                                         dep, registry=r),
        in_flight=Gauge("gateway_deployment_in_flight", "Requests the gateway has open", dep, registry=r),
        shadow_dropped=Counter("gateway_shadow_dropped", "Shadows not sent, by reason", ["target", "reason"],
                               registry=r),
        shadow_sent=Counter("gateway_shadow_requests", "Shadows sent, by result", ["target", "result"], registry=r),
        shadow_pairs=Counter("gateway_shadow_pairs", "Compared pairs, by outcome", ["target", "outcome"],
                             registry=r),
        rollout_requests=Counter("gateway_rollout_requests", "Requests by rollout arm", ["route", "arm"],
                                 registry=r),
        rollout_stale=Gauge("gateway_rollout_state_stale",
                            "1 while this replica serves stable for lack of a fresh rollout state", registry=r),
        rollout_weight=Gauge("gateway_rollout_weight_pct", "Candidate weight as this replica applies it", ["route"],
                             registry=r),
        policy_shadow_decisions=Counter("gateway_policy_shadow_decisions", "Candidate policy decisions on live traffic",
                                        ["candidate", "agreement"], registry=r),
        labels=Counter("gateway_labels", "Shadow pairs labelled: the weak side's answer against the strong side's",
                       ["verdict"], registry=r),
        labels_skipped=Counter("gateway_labels_skipped", "Shadow pairs that gave no label, by reason", ["reason"],
                               registry=r),
        judge_calls=Counter("gateway_judge_calls", "Calls to the labels judge, by result", ["result"], registry=r),
        labeller_dropped=Counter("gateway_labeller_dropped", "Pairs not labelled: the labeller's queue was full",
                                 registry=r),
        share_target=Gauge("gateway_complexity_share_target", "The HQ share a complexity rule asks for",
                           ["route", "share"], registry=r),
        share_observed=Gauge("gateway_complexity_share_observed",
                             "Share of the route's recent calls at or above the live threshold", ["route", "share"],
                             registry=r),
        share_threshold=Gauge("gateway_complexity_threshold", "The score threshold in force for a target share",
                              ["route", "share"], registry=r),
        agents=_agent_series(r),
    )


def watch(metrics: Metrics, series: tuple[str, str], read: Callable[[], float]) -> None:
    """A gauge read at scrape time from a resource's own count (the store's degraded flag, spans exported)."""
    name, help_text = series
    Gauge(name, help_text, registry=metrics.registry).set_function(read)


# The gauges that `watch` adds, named here so the one metrics module lists every series.
STORE_DEGRADED = ("gateway_store_degraded", "1 while the shared store (Redis) is unreachable")
STORE_PENDING_SETTLES = ("gateway_store_pending_settles", "Settles kept locally until the shared store answers again")
STORE_DROPPED_SETTLES = ("gateway_store_dropped_settles", "Settles dropped because the pending queue was full")
SPANS_EXPORTED = ("gateway_spans_exported", "Spans posted to the OTLP endpoint")
SPANS_DROPPED = ("gateway_spans_dropped", "Spans dropped: the export queue was full")
