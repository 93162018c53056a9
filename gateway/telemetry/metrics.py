"""Span attribute names (GenAI semantic conventions) and every Prometheus series the gateway exports."""

from __future__ import annotations

import bisect
import logging
import os
from collections import Counter as Tally
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from gateway.apis.usage import Usage

log = logging.getLogger(__name__)

# Set by `serve --workers N` (one fresh directory per run) before a worker imports prometheus_client: every
# worker then keeps its series in memory-mapped files there and any worker's /metrics merges them all.
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

# GenAI semantic-convention attribute names (opentelemetry semconv, gen_ai.*).
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_PROVIDER = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"  # of the input tokens, the cached
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
RESUMES = "gateway.resumes"  # each break of a streamed answer: "from -> to at N tokens: outcome (why)"
RESUMED_AT_TOKENS = "gateway.resumed_at_tokens"
COMPLEXITY = "gateway.complexity"
CONTEXT_EDITS = "gateway.context.edits"  # each edit made to the prompt: "type: cleared N, M tokens"
CONTEXT_TOKENS_BEFORE = "gateway.context.tokens_before"  # the prompt's tokens before the edits (gateway count)
CONTEXT_TOKENS_AFTER = "gateway.context.tokens_after"
CONTEXT_MASKED = "gateway.context.masked_outputs"  # old tool outputs given way to stubs (the policy's context rules)
CONTEXT_MASKED_TOKENS = "gateway.context.masked_tokens_saved"  # the prompt's tokens the stubs saved (gateway count)
CONTEXT_SUMMARIZED = "gateway.context.summarized_entries"  # old entries the summary sent stands for (0: none)
CONTEXT_SUMMARY_TOKENS = "gateway.context.summary_tokens_saved"  # their tokens less the summary's (gateway count)
CONTEXT_SUMMARY_DUE = "gateway.context.summary_due"  # the entry the rule's span now ends before
CONTEXT_SUMMARY_READY = "gateway.context.summary_ready"  # whether the summary sent is the span now due's
CONTEXT_RETRIEVED = "gateway.context.retrieved_pieces"  # offloaded pieces put back at the prompt's end
CONTEXT_RETRIEVED_TOKENS = "gateway.context.retrieved_tokens"  # the block's tokens (gateway count)
CONTEXT_MASK_FRONTIER = "gateway.context.mask_frontier"  # tool outputs before this index are masked
REQUEST_ID = "gateway.request_id"
CLIENT_REQUEST_ID = "gateway.client_request_id"
AGENT_STEP = "gateway.agent.step"
AGENT_TOOL_CALLS = "gateway.agent.tool_calls"  # names of the tool calls the model asked for
AGENT_FLAGS = "gateway.agent.flags"
AGENT_ACTION = "gateway.agent.action"
AGENT_FLAG_EVENT = "gateway.agent.flag"  # a span event: a loop or spike flag raised at this step
TOOL_ARGS_DIGEST = "gateway.tool.args_digest"
CACHE_PREDICTED_TOKENS = "gateway.cache.predicted_cached_tokens"  # of the prompt, on the serving deployment
CACHE_REPORTED_TOKENS = "gateway.cache.reported_cached_tokens"  # what the deployment reported, when it did
CACHE_UNCACHED_TOKENS = "gateway.cache.uncached_tokens"  # each deployment's predicted prefill: "hq=21230 ..."
AGENT_COMPACTION = "gateway.agent_compaction"  # the agent whose own compaction request this is (codex, claude-code)
CACHE_WARMUP = "gateway.cache.warmup"  # the warm-up this step triggered: "hq started", "hq busy" (decision/warmup)
COMPACTION_TRIGGER = "gateway.compaction.trigger"  # v1_compact | v2_trigger | context_management | anthropic_compact
COMPACTION_DEPLOYMENT = "gateway.compaction.deployment"  # the one that wrote the summary
COMPACTION_TOKENS_BEFORE = "gateway.compaction.tokens_before"  # the conversation it replaced
COMPACTION_TOKENS_AFTER = "gateway.compaction.tokens_after"  # what stands in for it: kept messages and summary
COMPACTION_ITEMS_OPENED = "gateway.compaction.items_opened"  # compaction items sent back, expanded

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


@dataclass(slots=True)
class ScoringCost:
    """Time spent in the classifier, summed in plain attributes (a Counter's lock would cost more than a
    score) and added to gateway_classifier_seconds_total / gateway_classifier_scores_total when folded."""

    seconds: float = 0.0
    scores: int = 0


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
    outcomes: Counter
    outcome_cost: Counter
    outcome_steps: Counter
    outcomes_replaced: Counter


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
                      "takes", ["tenant", "flag", "action"], registry=r),
        actions=Counter("gateway_agent_actions", "Requests escalated, steered or stopped for a session's flag",
                        ["tenant", "flag", "action"], registry=r),
        dropped=Counter("gateway_agent_steps_dropped", "Steps not recorded (queue full, store unreachable)",
                        ["reason"], registry=r),
        **_outcome_series(r),
    )


@dataclass(frozen=True)
class CacheSeries:
    """Each agent session's prefix caches as the gateway predicts them (policy `switch`), per step served: the
    prompt tokens the serving deployment held and those it prefilled, the sessions' moves between deployments,
    and the prediction against what the deployment reported (`cached_tokens`). Ratios in PromQL: uncached /
    (cached + uncached) (the share prefilled), switches / steps."""

    predicted: Counter
    switches: Counter
    prediction_error: Histogram
    misses: Counter
    warmups: Counter
    warmup_tokens: Counter


class BatchedCounts:
    """Increments of a group of series (`AgentSeries`, `CacheSeries`) gathered where they happen and handed to
    Prometheus at once by `apply`: each write to a series takes its lock and a label lookup, which cost more amid
    a request or a step, its code cold in the caches, than the rest of its counting. Counters are summed per
    series and labels; a histogram's observations are kept per series and labels, and observed together."""

    def __init__(self, series: object) -> None:
        self._series = series
        self._children: dict[tuple[str, ...], Any] = {}
        self._sums: dict[tuple[str, ...], float] = {}
        self._observed: dict[tuple[str, ...], list[float]] = {}

    def child(self, series: str, *labels: str) -> Any:
        """The labelled series, looked up once (for a write that is not worth batching: a rare one)."""
        key = (series, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = getattr(self._series, series).labels(*labels)
        return child

    def add(self, series: str, *labels: str, by: float = 1.0) -> None:
        key = (series, *labels)
        self._sums[key] = self._sums.get(key, 0.0) + by

    def observe(self, series: str, *labels: str, value: float) -> None:
        self._observed.setdefault((series, *labels), []).append(value)

    @property
    def pending(self) -> bool:
        return bool(self._sums or self._observed)

    def apply(self) -> None:
        sums, self._sums = self._sums, {}
        observed, self._observed = self._observed, {}
        for (series, *labels), total in sums.items():
            self.child(series, *labels).inc(total)
        for (series, *labels), values in observed.items():
            _observe_all(self.child(series, *labels), values)


# The prediction's error in tokens: vLLM caches whole blocks (16 tokens), so errors under a block are rounding.
CACHE_ERROR_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)
CACHE_SESSION_LABELS = ["deployment", "kind"]  # kind: cached | uncached


def _cache_series(r: CollectorRegistry) -> CacheSeries:
    return CacheSeries(
        predicted=Counter("gateway_session_cache_predicted_tokens", "Prompt tokens of agent steps the serving "
                          "deployment held in its prefix cache (cached) or prefilled (uncached), as predicted",
                          CACHE_SESSION_LABELS, registry=r),
        switches=Counter("gateway_session_switches", "Agent steps served by another deployment than the "
                         "session's last step", ["from_deployment", "to_deployment"], registry=r),
        prediction_error=Histogram("gateway_session_cache_prediction_error_tokens", "Predicted cached tokens "
                                   "minus those the deployment reported, absolute", ["deployment"],
                                   buckets=CACHE_ERROR_BUCKETS, registry=r),
        misses=Counter("gateway_session_cache_misses", "Steps whose deployment reported fewer cached tokens than "
                       "predicted, by more than a block (an eviction, or a prompt rewritten)", ["deployment"],
                       registry=r),
        warmups=Counter("gateway_cache_warmups", "Warm-ups of a deployment's prefix cache with an agent session's "
                        "prompt, by how each ended (decision/warmup.Outcome)", ["deployment", "outcome"],
                        registry=r),
        warmup_tokens=Counter("gateway_cache_warmup_tokens", "Prompt tokens warm-ups sent, by whether the "
                              "deployment prefilled them (uncached) or held them already (cached)",
                              CACHE_SESSION_LABELS, registry=r),
    )


OUTCOME_LABELS = ["route", "mix", "arm", "outcome"]


def _outcome_series(r: CollectorRegistry) -> dict[str, Counter]:
    """Task outcomes per route, deployment mix (the deployments a session's steps went to, e.g. "fast+hq") and
    rollout arm (candidate, control, none), by outcome (success, failure), counted at a session's first
    report. Ratios in PromQL: outcomes{outcome="success"} / outcomes (success rate), outcome_cost /
    outcomes (cost per session), sum(outcome_cost) / outcomes{outcome="success"} (cost per solved task:
    the failures' spend charged to the successes), outcome_steps{outcome="success"} /
    outcomes{outcome="success"} (steps per successful session)."""
    return {
        "outcomes": Counter("gateway_agent_session_outcomes", "Agent sessions with a reported outcome, at their "
                            "first report", OUTCOME_LABELS, registry=r),
        "outcome_cost": Counter("gateway_agent_session_outcome_cost_usd", "Spend of the sessions with a reported "
                                "outcome, as of their first report", OUTCOME_LABELS, registry=r),
        "outcome_steps": Counter("gateway_agent_session_outcome_steps", "Steps of the sessions with a reported "
                                 "outcome, as of their first report", OUTCOME_LABELS, registry=r),
        "outcomes_replaced": Counter("gateway_agent_session_outcomes_replaced", "Outcome reports that replaced an "
                                     "earlier one, by the earlier and the new outcome",
                                     ["route", "previous", "outcome"], registry=r),
    }


@dataclass(frozen=True)
class Metrics:
    """The gateway's Prometheus series, in a registry of its own (one per app); `exposed` is what /metrics
    renders: that registry, or with several workers the merge of every worker's files."""

    registry: CollectorRegistry
    exposed: CollectorRegistry
    requests: Counter
    latency: Histogram
    ttft: Histogram
    tokens: Counter
    tenant_tokens: Counter
    spend: Counter
    cached_tokens: Counter
    cached_overstated: Counter
    failovers: Counter
    stream_resumes: Counter
    policy_reloads: Counter
    policy_valid: Gauge
    deployment_healthy: Gauge
    deployment_waiting: Gauge
    deployment_running: Gauge
    deployment_kv_cache: Gauge
    deployment_spec_acceptance: Gauge
    deployment_window: Gauge
    deployment_counts: Counter
    in_flight: Gauge
    shadow_dropped: Counter
    shadow_sent: Counter
    shadow_pairs: Counter
    rollout_requests: Counter
    rollout_stale: Gauge
    rollout_weight: Gauge
    rollout_phase: Gauge
    rollout_step: Gauge
    rollout_verdict: Gauge
    policy_shadow_decisions: Counter
    labels: Counter
    labels_skipped: Counter
    judge_calls: Counter
    labeller_dropped: Counter
    share_target: Gauge
    share_observed: Gauge
    share_threshold: Gauge
    agents: AgentSeries
    caches: CacheSeries
    classifier_seconds: Counter
    classifier_scores: Counter
    context_edits: Counter
    context_cleared_tokens: Counter
    context_masked_outputs: Counter
    context_masked_tokens: Counter
    context_offloads: Counter
    context_summaries: Counter
    context_retrievals: Counter
    context_retrieved_pieces: Counter
    context_retrieved_tokens: Counter
    context_summarized_entries: Counter
    context_summary_tokens: Counter
    context_offloaded_bytes: Counter
    compactions: Counter
    agent_compaction_requests: Counter
    compaction_tokens: Counter
    compaction_cost_usd: Counter
    # prometheus_client validates and hashes label values on every .labels() call; the label sets are
    # few, so each child is looked up once and kept.
    request_children: dict[tuple[str, str, str, str], tuple[Any, Any, Any]] = field(default_factory=dict)
    token_children: dict[tuple[str, str], tuple[Any, ...]] = field(default_factory=dict)
    scoring: ScoringCost = field(default_factory=ScoringCost)
    spec_decode: SpecDecodeCounts = field(default_factory=SpecDecodeCounts)
    scoring_folded: ScoringCost = field(default_factory=ScoringCost)
    watched: list[tuple[Gauge, Callable[[], float]]] = field(default_factory=list)

    # Each request's figures wait here and reach the series in batches: prometheus_client takes a lock
    # and scans the buckets per observation, which in place, amid a request, runs with its code and data cold
    # in the caches; applied FOLD_EVERY at a time, with them warm, the same work costs a fraction as much
    # (docs/performance.md, 'Why the code is shaped so'). A scrape folds first.
    pending: list[tuple[str, str, str, str, float, float | None]] = field(default_factory=list)
    pending_tokens: list[tuple[str, str, Usage, float]] = field(default_factory=list)

    def render(self) -> bytes:
        self.fold()
        return generate_latest(self.exposed)

    def observe_request(
        self, endpoint: str, deployment: str, rule: str, status: str, elapsed_s: float, ttft_s: float | None
    ) -> None:
        self.pending.append((endpoint, deployment, rule, status, elapsed_s, ttft_s))
        if len(self.pending) >= FOLD_EVERY:
            self.fold()

    def count_tokens(self, deployment: str, tenant: str, usage: Usage, cost_usd: float) -> None:
        self.pending_tokens.append((deployment, tenant, usage, cost_usd))

    def count_context_edit(self, api: str, edit: str, cleared_input_tokens: int) -> None:
        """One context edit the gateway made to a prompt (rare next to requests: counted in place)."""
        self.context_edits.labels(api, edit).inc()
        self.context_cleared_tokens.labels(api, edit).inc(max(cleared_input_tokens, 0))

    def count_masking(self, api: str, masked: int, tokens_saved: int) -> None:
        """Old tool outputs one prompt sent as stubs, and the tokens that saved."""
        self.context_masked_outputs.labels(api).inc(masked)
        self.context_masked_tokens.labels(api).inc(max(tokens_saved, 0))

    def count_summarized(self, api: str, entries: int, tokens_saved: int) -> None:
        """Old entries one prompt sent as a summary, and the tokens that saved."""
        self.context_summarized_entries.labels(api).inc(entries)
        self.context_summary_tokens.labels(api).inc(max(tokens_saved, 0))

    def count_offload(self, outcome: str, objects: int, stored_bytes: int = 0) -> None:
        """Masked originals written to the object store (stored) or not (failed: the prompt went unmasked)."""
        self.context_offloads.labels(outcome).inc(objects)
        if stored_bytes:
            self.context_offloaded_bytes.inc(stored_bytes)
    def count_compaction(self, api: str, trigger: str, deployment: str, tokens_before: int,
                         tokens_after: int) -> None:
        """One summary written (rare beside requests: applied at once)."""
        self.compactions.labels(api, trigger, deployment).inc()
        self.compaction_tokens.labels(api, trigger, "before").inc(tokens_before)
        self.compaction_tokens.labels(api, trigger, "after").inc(tokens_after)

    def fold(self) -> None:
        """Apply the waiting figures to the Prometheus series (at a scrape, every FOLD_EVERY requests and,
        with several workers, every FOLD_S so that another worker's scrape sees them)."""
        self._fold_requests()
        self._fold_tokens()
        self._fold_scoring()
        for gauge, read in self.watched:
            gauge.set(read())

    # Each write to a series takes a lock and, with several workers, updates a memory-mapped file: a fold
    # adds up its batch first and writes each series it touches once.
    def _fold_requests(self) -> None:
        pending = self.pending.copy()
        self.pending.clear()
        counts: dict[Any, int] = {}
        observed: dict[Any, list[float]] = {}
        for endpoint, deployment, rule, status, elapsed_s, ttft_s in pending:
            requests, latency, ttft = self._request_children(endpoint, deployment, rule, status)
            counts[requests] = counts.get(requests, 0) + 1
            observed.setdefault(latency, []).append(elapsed_s)
            if ttft_s is not None:
                observed.setdefault(ttft, []).append(ttft_s)
        for child, count in counts.items():
            child.inc(count)
        for child, values in observed.items():
            _observe_all(child, values)

    def _fold_tokens(self) -> None:
        tokens = self.pending_tokens.copy()
        self.pending_tokens.clear()
        sums: dict[tuple[str, str], list[float]] = {}
        for deployment, tenant, usage, cost_usd in tokens:
            total = sums.setdefault((deployment, tenant), [0, 0, 0.0, 0, 0])
            total[0] += usage.prompt_tokens
            total[1] += usage.completion_tokens
            total[2] += cost_usd
            total[3] += usage.cached_tokens
            total[4] += usage.cached_overstated
        for (deployment, tenant), (tokens_in, tokens_out, spent_usd, cached, overstated) in sums.items():
            inputs, outputs, tenant_inputs, tenant_outputs, spend, cached_inputs, lies = \
                self._token_children(deployment, tenant)
            inputs.inc(tokens_in)
            outputs.inc(tokens_out)
            tenant_inputs.inc(tokens_in)
            tenant_outputs.inc(tokens_out)
            spend.inc(spent_usd)
            cached_inputs.inc(cached)  # a zero still creates the series: a deployment without hits reads 0
            if overstated:
                lies.inc(overstated)

    def _fold_scoring(self) -> None:
        cost, folded = self.scoring, self.scoring_folded
        if cost.scores != folded.scores:
            self.classifier_seconds.inc(cost.seconds - folded.seconds)
            self.classifier_scores.inc(cost.scores - folded.scores)
            folded.seconds, folded.scores = cost.seconds, cost.scores

    def _request_children(self, endpoint: str, deployment: str, rule: str, status: str) -> tuple[Any, Any, Any]:
        key = (endpoint, deployment, rule, status)
        children = self.request_children.get(key)
        if children is None:
            children = (self.requests.labels(*key), self.latency.labels(endpoint, deployment),
                        self.ttft.labels(deployment))
            self.request_children[key] = children
        return children

    def _token_children(self, deployment: str, tenant: str) -> tuple[Any, ...]:
        children = self.token_children.get((deployment, tenant))
        if children is None:
            children = (self.tokens.labels(deployment, "input"), self.tokens.labels(deployment, "output"),
                        self.tenant_tokens.labels(tenant, "input"), self.tenant_tokens.labels(tenant, "output"),
                        self.spend.labels(tenant, deployment), self.cached_tokens.labels(deployment),
                        self.cached_overstated.labels(deployment))
            self.token_children[(deployment, tenant)] = children
        return children

    def totals(self, family: str) -> dict[tuple[tuple[str, str], ...], float]:
        """A counter's current values by label set, as /metrics would show them (merged across workers)."""
        self.fold()
        found: dict[tuple[tuple[str, str], ...], float] = {}
        for metric in self.exposed.collect():
            if metric.name != family:
                continue
            for sample in metric.samples:
                if sample.name == family + "_total":
                    key = tuple(sorted(sample.labels.items()))
                    found[key] = found.get(key, 0.0) + sample.value
        return found


Mode = Literal["livemax", "livemin", "livesum", "livemostrecent"]  # how several workers' gauge values merge
def _observe_all(histogram: Any, values: list[float]) -> None:
    """Observe many values with one write per bucket touched and one to the sum (the result observe() would
    give). It reaches into prometheus_client's histogram child; another layout falls back to observe()."""
    bounds, buckets, total = (getattr(histogram, name, None) for name in ("_upper_bounds", "_buckets", "_sum"))
    if bounds is None or buckets is None or total is None:
        for value in values:
            histogram.observe(value)
        return
    for index, count in Tally(bisect.bisect_left(bounds, value) for value in values).items():
        buckets[index].inc(count)  # the first bucket whose upper bound is >= the value, as observe() picks
    total.inc(sum(values))


FOLD_EVERY = 256
FOLD_S = 1.0  # with several workers: how stale another worker's figures may be in a scrape


def multiprocess_dir() -> str | None:
    """The directory the workers of this run share their series in, or None in a single process."""
    return os.environ.get(MULTIPROC_DIR_ENV) or None


def forget_worker(pid: int) -> None:
    """Drop an ended worker's live gauges (its counters and histograms stay counted)."""
    path = multiprocess_dir()
    if path is not None:
        multiprocess.mark_process_dead(pid, path)  # type: ignore[no-untyped-call]


def _exposed(registry: CollectorRegistry) -> CollectorRegistry:
    path = multiprocess_dir()
    if path is None:
        return registry
    merged = CollectorRegistry()
    multiprocess.MultiProcessCollector(merged, path)  # type: ignore[no-untyped-call]
    return merged


def make_metrics() -> Metrics:
    r = CollectorRegistry()
    dep = ["deployment"]
    spec_decode = SpecDecodeCounts()
    r.register(_SpecDecodeCollector(spec_decode))
    exposed = _exposed(r)
    if exposed is not r:  # a collector is no file: the answering worker's counts (the same in every worker)
        exposed.register(_SpecDecodeCollector(spec_decode))
    # With several workers a gauge's value is one per worker: each says how they merge (the "live" modes
    # forget a worker that has ended). A single process ignores the mode.
    same: Mode = "livemostrecent"  # every worker holds the same shared figure: the latest write is the truth
    return Metrics(
        spec_decode=spec_decode,
        registry=r,
        exposed=exposed,
        requests=Counter("gateway_requests", "Requests by outcome", ["endpoint", "deployment", "rule", "status"],
                         registry=r),
        latency=Histogram("gateway_request_duration_seconds", "Time to the last byte", ["endpoint", "deployment"],
                          buckets=LATENCY_BUCKETS_S, registry=r),
        ttft=Histogram("gateway_time_to_first_token_seconds", "Time to the first streamed chunk", dep,
                       buckets=LATENCY_BUCKETS_S, registry=r),
        tokens=Counter("gateway_tokens", "Tokens reported by deployments", ["deployment", "direction"], registry=r),
        tenant_tokens=Counter("gateway_tenant_tokens", "Tokens reported by deployments, by tenant",
                              ["tenant", "direction"], registry=r),
        spend=Counter("gateway_spend_usd", "Cost of the reported tokens at the deployment's prices",
                      ["tenant", "deployment"], registry=r),
        cached_tokens=Counter("gateway_cached_tokens", "Prompt tokens the deployment reported read from its prefix "
                              "cache (part of gateway_tokens direction=input; priced at its cached input price)",
                              dep, registry=r),
        cached_overstated=Counter("gateway_usage_cached_overstated", "Usages whose cached tokens exceeded their "
                                  "prompt tokens (clamped to the prompt's)", dep, registry=r),
        failovers=Counter("gateway_failovers", "Attempts moved to the next deployment", ["from_deployment", "reason"],
                          registry=r),
        stream_resumes=Counter("gateway_stream_resumes", "Streams that broke after their first byte, by the "
                               "deployment that broke, the one that went on (none) and the outcome",
                               ["from", "to", "outcome"], registry=r),
        policy_reloads=Counter("gateway_policy_reloads", "Policy reloads by result", ["result"], registry=r),
        context_edits=Counter("gateway_context_edits", "Context edits the gateway made to prompts, by API and edit "
                              "(clear_tool_uses_20250919, clear_thinking_20251015, compact_20260112)", ["api", "edit"],
                              registry=r),
        context_cleared_tokens=Counter("gateway_context_cleared_tokens", "Input tokens the context edits took out "
                                       "of prompts (the gateway's count)", ["api", "edit"], registry=r),
        context_masked_outputs=Counter("gateway_context_masked_outputs", "Old tool outputs sent as stubs by the "
                                       "policy's context rules, by API (each prompt's, every step)", ["api"],
                                       registry=r),
        context_masked_tokens=Counter("gateway_context_masked_tokens_saved", "Prompt tokens the stubs of masked "
                                      "tool outputs saved (the gateway's count), by API", ["api"], registry=r),
        context_offloads=Counter("gateway_context_offloads", "Masked tool outputs written to the object store, by "
                                 "outcome (stored; failed: the prompt was sent unmasked)", ["outcome"], registry=r),
        context_summaries=Counter("gateway_context_summaries", "Summaries of old turns the gateway wrote after a "
                                  "step, by outcome (written; failed; budget: no room in the tenant's budget; "
                                  "busy: too many being written)", ["outcome"], registry=r),
        context_retrievals=Counter("gateway_context_retrievals", "Prompts retrieval looked at, by outcome "
                                   "(put_back: a block went in; none: no piece was relevant enough; index_dropped: "
                                   "a piece was not indexed, too many waiting)", ["outcome"], registry=r),
        context_retrieved_pieces=Counter("gateway_context_retrieved_pieces", "Offloaded pieces (masked outputs, "
                                         "summarized entries) put back at a prompt's end", registry=r),
        context_retrieved_tokens=Counter("gateway_context_retrieved_tokens", "Tokens of the retrieved blocks put "
                                         "in prompts (the gateway's count), by API", ["api"], registry=r),
        context_summarized_entries=Counter("gateway_context_summarized_entries", "Old messages or items sent as "
                                           "a summary by the policy's context rules, by API (each prompt's)",
                                           ["api"], registry=r),
        context_summary_tokens=Counter("gateway_context_summary_tokens_saved", "Prompt tokens the summaries of "
                                       "old turns saved (the gateway's count), by API", ["api"], registry=r),
        context_offloaded_bytes=Counter("gateway_context_offloaded_bytes", "Bytes of masked tool outputs written to "
                                        "the object store", registry=r),
        policy_valid=Gauge("gateway_policy_last_reload_ok", "1 when the last policy reload succeeded", registry=r,
                           multiprocess_mode="livemin"),
        deployment_healthy=Gauge("gateway_deployment_healthy", "1 when routable", dep, registry=r,
                                 multiprocess_mode=same),
        deployment_waiting=Gauge("gateway_deployment_requests_waiting", "vLLM queue depth", dep, registry=r,
                                 multiprocess_mode=same),
        deployment_running=Gauge("gateway_deployment_requests_running", "vLLM running requests", dep, registry=r,
                                 multiprocess_mode=same),
        deployment_kv_cache=Gauge("gateway_deployment_kv_cache_usage_ratio", "vLLM KV cache usage", dep, registry=r,
                                  multiprocess_mode=same),
        deployment_spec_acceptance=Gauge("gateway_deployment_spec_decode_acceptance_ratio",
                                         "Accepted / drafted speculative tokens since the deployment started",
                                         dep, registry=r, multiprocess_mode=same),
        deployment_window=Gauge("gateway_deployment_context_window_tokens", "The context window the deployment "
                                "reports (vLLM's max_model_len)", dep, registry=r, multiprocess_mode=same),
        deployment_counts=Counter("gateway_deployment_prompt_counts", "Prompts near a deployment's window counted in "
                                  "its tokens, by outcome: counted (its /tokenize, for the new part), memo (no new "
                                  "part), failed (a bound from cl100k was used)", ["deployment", "outcome"],
                                  registry=r),
        in_flight=Gauge("gateway_deployment_in_flight", "Requests the gateway has open", dep, registry=r,
                        multiprocess_mode="livesum"),
        shadow_dropped=Counter("gateway_shadow_dropped", "Shadows not sent, by reason", ["target", "reason"],
                               registry=r),
        shadow_sent=Counter("gateway_shadow_requests", "Shadows sent, by result", ["target", "result"], registry=r),
        shadow_pairs=Counter("gateway_shadow_pairs", "Compared pairs, by outcome", ["target", "outcome"],
                             registry=r),
        rollout_requests=Counter("gateway_rollout_requests", "Requests by rollout arm", ["route", "arm"],
                                 registry=r),
        rollout_stale=Gauge("gateway_rollout_state_stale",
                            "1 while this replica serves stable for lack of a fresh rollout state", registry=r,
                            multiprocess_mode="livemax"),
        rollout_weight=Gauge("gateway_rollout_weight_pct", "Candidate weight as this replica applies it", ["route"],
                             registry=r, multiprocess_mode="livemax"),
        rollout_phase=Gauge("gateway_rollout_phase", "1 for the phase the route's rollout is in, else 0",
                            ["route", "phase"], registry=r, multiprocess_mode=same),
        rollout_step=Gauge("gateway_rollout_step", "Index of the step the route's rollout executes or waits on",
                           ["route"], registry=r, multiprocess_mode=same),
        rollout_verdict=Gauge("gateway_rollout_verdict", "1 for each guard's current interim status (the leader's "
                              "last tick), else 0", ["route", "guard", "status"], registry=r, multiprocess_mode=same),
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
                           ["route", "share"], registry=r, multiprocess_mode=same),
        share_observed=Gauge("gateway_complexity_share_observed",
                             "Share of the route's recent calls at or above the live threshold", ["route", "share"],
                             registry=r, multiprocess_mode=same),
        share_threshold=Gauge("gateway_complexity_threshold", "The score threshold in force for a target share",
                              ["route", "share"], registry=r, multiprocess_mode=same),
        classifier_seconds=Counter("gateway_classifier_seconds", "Wall time spent scoring requests (in the event "
                                   "loop, so about its CPU time)", registry=r),
        classifier_scores=Counter("gateway_classifier_scores", "Requests scored by the classifier", registry=r),
        agent_compaction_requests=Counter(
            "gateway_agent_compaction_requests", "The coding agents' own compaction requests (Codex's compaction turn, "
            "Claude Code's summary request), served on the largest window", ["agent", "deployment"], registry=r),
        compactions=Counter("gateway_compactions", "Conversations the gateway summarized for a client, by API, "
                            "who asked (v1_compact, v2_trigger, context_management, anthropic_compact) and "
                            "the summarizing deployment", ["api", "trigger", "deployment"], registry=r),
        compaction_tokens=Counter("gateway_compaction_tokens", "Context tokens of compacted conversations, before "
                                  "(what was summarized) and after (kept messages and the summary); the ratio is "
                                  "the compaction's gain", ["api", "trigger", "stage"], registry=r),
        compaction_cost_usd=Counter("gateway_compaction_cost_usd", "What compactions cost (also in the "
                                    "tenant's and the session's spend), by who asked (the gateway's triggers, or "
                                    "an agent's own summary request: codex, claude-code) and the summarizing "
                                    "deployment", ["trigger", "deployment"], registry=r),
        agents=_agent_series(r),
        caches=_cache_series(r),
    )


def watch(metrics: Metrics, series: Series, read: Callable[[], float]) -> None:
    """A gauge read from a resource's own count (the store's degraded flag, spans exported) whenever the
    metrics fold; the third item of `series` says how the workers' values merge."""
    name, help_text, mode = series
    gauge = Gauge(name, help_text, registry=metrics.registry, multiprocess_mode=mode)
    gauge.set(read())
    metrics.watched.append((gauge, read))


def export_native(metrics: Metrics, loaded: Mapping[str, bool]) -> None:
    """gateway_native_info: 1 per C extension, loaded="true" where it runs, "false" where its Python twin does."""
    info = Gauge("gateway_native_info", "C extensions of this process: loaded (true) or their Python twin runs "
                 "(false)", ["extension", "loaded"], registry=metrics.registry, multiprocess_mode="livemostrecent")
    for extension, ok in loaded.items():
        info.labels(extension, "true" if ok else "false").set(1)


# The gauges that `watch` adds, named here so the one metrics module lists every series.
Series = tuple[str, str, Mode]
STORE_DEGRADED: Series = ("gateway_store_degraded", "1 while the shared store (Redis) is unreachable", "livemax")
STORE_PENDING_SETTLES: Series = ("gateway_store_pending_settles",
                                 "Settles kept locally until the shared store answers again", "livesum")
STORE_DROPPED_SETTLES: Series = ("gateway_store_dropped_settles", "Settles dropped because the pending queue was full",
                                 "livesum")
SPANS_EXPORTED: Series = ("gateway_spans_exported", "Spans the collector took", "livesum")
SPANS_DROPPED: Series = ("gateway_spans_dropped", "Spans dropped: the export queue was full or the export failed",
                         "livesum")
