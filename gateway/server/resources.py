"""The app's state, one typed object (its resources created and closed in create_app's cleanup contexts), and
the per-request keys the middleware sets (server/middleware.py)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.accounting.ledger import Accounting
from gateway.agents.recorder import Trajectories
from gateway.apis.recurring import Recurring
from gateway.classifier.scoring import Classifier
from gateway.context.anthropic_edits import Managed
from gateway.context.masking import Masking
from gateway.context.seal import Seal
from gateway.decision.call import Call
from gateway.decision.routing import Context, Decision
from gateway.decision.share import ShareTracker
from gateway.experiments.hook import Experiments
from gateway.features import Features
from gateway.policy.model import Policy
from gateway.server.evictions import Evictions
from gateway.server.offload import Offload
from gateway.server.policy_file import PolicyFile
from gateway.server.resume_splice import TranscriptMemory
from gateway.server.retrieval import Library
from gateway.server.session_caches import SessionCaches
from gateway.server.settings import Settings
from gateway.server.warmups import Warmups
from gateway.store.conversations import Conversations
from gateway.store.opening import Stores
from gateway.telemetry.exchange import Exchange
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.spans import Spans
from gateway.telemetry.traffic import TrafficWindows
from gateway.upstream.client import Pool
from gateway.upstream.deployment_counts import DeploymentCounts
from gateway.upstream.deployments import Deployments


@dataclass(slots=True)
class Remembered:
    """A live decision's inputs (to recompute its full trail: decide is pure) and the decision as served."""

    policy: Policy
    features: Features
    ctx: Context
    served: Decision  # after the rollout arm and the budget hold, which may narrow the failover
    resumes: tuple[str, ...] = ()  # each break of its stream, and what became of it
    context: Managed | None = None  # the context edits that made the prompt (its body is not kept: see below)
    masking: Masking | None = None  # the old tool outputs masked in the prompt (their originals are not kept)
    compactions: tuple[str, ...] = ()  # each summary the gateway wrote for it
    context_notes: dict[str, Any] | None = None  # what the policy's summaries and retrieval did to its prompt


class Recent:
    """The last N live decisions, for `/admin/requests/{id}/explain`.

    It is most of what a busy gateway keeps of its requests (~1 KB each, N = 2,048 by default), and it fills over
    the first N requests: each entry shares its context's snapshots (the deployments' load, the share thresholds,
    the windows' fits, the headers the policy reads) with the entry before it when they are equal, as they are
    between most consecutive requests, rather than keeping a copy of each.
    """

    def __init__(self, size: int) -> None:
        self._size = size
        self._items: OrderedDict[str, Remembered] = OrderedDict()

    def remember(self, request_id: str, call: Call, ctx: Context, served: Decision,
                 context_notes: dict[str, Any] | None = None) -> None:
        # The context holds only the headers the policy reads (decision/gathering.gather), never the request's
        # own: the last 2,048 requests' could hold gigabytes.
        last = self._items[next(reversed(self._items))] if self._items else None
        if last is not None:  # neither is changed after its decision: the previous entry's copies serve
            _share(ctx, last.ctx, _SNAPSHOTS)
            _share(served, last.served, ("attempts", "reasons"))
        self._items[request_id] = Remembered(call.policy, call.features, ctx, served,
                                             context=None if call.context is None else call.context.without_body(),
                                             masking=None if call.masking is None else call.masking.without_originals(),
                                             context_notes=context_notes)
        if len(self._items) > self._size:
            self._items.popitem(last=False)

    def resumed(self, request_id: str, description: str) -> None:
        found = self._items.get(request_id)
        if found is not None:
            found.resumes += (description,)

    def compacted(self, request_id: str, description: str) -> None:
        found = self._items.get(request_id)
        if found is not None:
            found.compactions += (description,)

    def get(self, request_id: str) -> Remembered | None:
        return self._items.get(request_id)


# The context's fields that are snapshots of shared state, equal between most consecutive requests.
_SNAPSHOTS = ("headers", "load", "in_flight", "share_thresholds", "fits")


def _share(kept: object, last: object, names: tuple[str, ...]) -> None:
    """Each of these fields of `kept` made to hold last's value where the two are equal. Set in place: an equal
    value reads the same to whoever holds `kept` (the request's own stages are done with it), and a copy of the
    whole object per request cost more than the comparisons."""
    for name in names:
        theirs = getattr(last, name)
        if getattr(kept, name) == theirs:
            setattr(kept, name, theirs)


class AppState:
    """Everything the app holds, one typed attribute per resource. The request-independent ones come with the app;
    the rest are set by create_app's cleanup contexts, in their order (each may use those set before it), before the
    first request. One object under one key: handlers and stages read `request.app[STATE].pool`, and the admin
    sub-app shares the very object."""

    __slots__ = (
        "accounting",
        "classifier",
        "conversations",
        "counts",
        "deployments",
        "evictions",
        "experiments",
        "library",
        "metrics",
        "offload",
        "policy_file",
        "pool",
        "recent",
        "recurring",
        "seal",
        "session_caches",
        "settings",
        "shares",
        "spans",
        "stores",
        "traffic",
        "trajectories",
        "transcripts",
        "warmups",
    )

    settings: Settings
    recent: Recent
    recurring: Recurring  # agents' conversations parsed once: each step re-sends the steps before it
    transcripts: TranscriptMemory  # what streams hold for a resume to read back, all of them together
    traffic: TrafficWindows  # readings of the request counters, for /admin/deployments
    seal: Seal  # seals and opens the compaction items clients send back
    pool: Pool  # the one pool of connections to the deployments
    metrics: Metrics  # every Prometheus series
    spans: Spans | None  # the span exporter (None when AGENT_GATEWAY_TRACES=none)
    policy_file: PolicyFile
    deployments: Deployments
    counts: DeploymentCounts  # prompts near a window, in the deployment's own tokens
    classifier: Classifier
    stores: Stores
    offload: Offload  # masked tool outputs and the object store of their originals
    conversations: Conversations  # the Responses API's stored responses
    shares: ShareTracker  # live complexity-share thresholds
    accounting: Accounting
    session_caches: SessionCaches  # each agent session's prefix caches
    warmups: Warmups  # the deployments' caches warmed for sessions' next steps
    evictions: Evictions  # summaries of old turns, ready and being written
    library: Library  # the index of offloaded pieces retrieval puts back
    experiments: Experiments
    trajectories: Trajectories

    def __init__(self, settings: Settings, recent: Recent, traffic: TrafficWindows, seal: Seal) -> None:
        self.settings, self.recent, self.traffic, self.seal = settings, recent, traffic, seal
        self.recurring = Recurring(settings.recurring_bytes)
        self.transcripts = TranscriptMemory(settings.resume_memory_bytes)


STATE = web.AppKey("state", AppState)

EXCHANGE = web.RequestKey("exchange", Exchange)
REQUEST_ID = web.RequestKey("request_id", str)
TENANT = web.RequestKey("tenant", str)
