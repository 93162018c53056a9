"""create_app(settings): the app's one state object (server/resources.py), one cleanup context per resource that
sets its attribute, the middleware chain, the routes and the admin sub-app."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import tempfile
import time
from collections.abc import AsyncIterator

from aiohttp import web

from gateway import native
from gateway.accounting.ledger import Accounting
from gateway.agents.recorder import Trajectories
from gateway.apis.routes import BY_PATH
from gateway.classifier.scoring import Classifier
from gateway.decision.share import ShareTracker
from gateway.experiments.hook import Experiments
from gateway.experiments.labeller import Labeller
from gateway.experiments.request_log import RequestLog
from gateway.experiments.rollouts import Rollouts
from gateway.experiments.shadows import Shadows
from gateway.experiments.shares import keep_in_step
from gateway.features import load_encoding
from gateway.policy.model import Policy, PolicyError
from gateway.server import (
    admin_app,
    compaction,
    context_api,
    conversations,
    middleware,
    outcome_api,
    pipeline,
    public,
    ui,
)
from gateway.server.evictions import Evictions
from gateway.server.offload import Offload
from gateway.server.policy_file import PolicyFile
from gateway.server.resources import STATE, AppState, Recent
from gateway.server.retrieval import Library
from gateway.server.session_caches import SessionCaches
from gateway.server.settings import Settings
from gateway.server.warmups import Warmups
from gateway.store.conversations import Conversations
from gateway.store.fallback import FallbackStore
from gateway.store.objects import DiskObjects
from gateway.store.opening import open_objects, open_stores
from gateway.telemetry import metrics as m
from gateway.telemetry.export_process import ExportProcess
from gateway.telemetry.spans import BoundedBatches, Spans, make_spans
from gateway.telemetry.traffic import TrafficWindows
from gateway.upstream import forward as upstream
from gateway.upstream.board import Board
from gateway.upstream.deployment_counts import DeploymentCounts
from gateway.upstream.deployments import Deployments, Tracked

log = logging.getLogger(__name__)


def create_app(settings: Settings) -> web.Application:
    # The body limit is enforced by pipeline.read_body with a clear message; aiohttp's own cap sits above it.
    app = web.Application(client_max_size=settings.max_body_bytes + 1)
    app.middlewares.extend(middleware.chain(app))
    # a production gateway without its seal's key fails here, at start
    app[STATE] = AppState(settings, Recent(settings.explain_memory), TrafficWindows(time.time()),
                          compaction.make_seal(settings))
    # In order: each context may use the resources of those before it, and closes after them.
    app.cleanup_ctx.extend([_pool, _telemetry, _policy, _deployments, _classifier, _stores, _offload, _conversations,
                            _shares, _accounting, _session_caches, _experiments, _trajectories, _long_lived_heap])
    for path, adapter in BY_PATH.items():
        app.router.add_post(path, pipeline.handler(adapter))
    public.add_routes(app.router)
    conversations.add_routes(app.router)
    context_api.add_routes(app.router)
    ui.add_routes(app.router)
    outcome_api.install(app)
    admin_app.mount(app)  # everything under /admin/, behind the admin token
    return app


async def _pool(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    state.pool = pool = upstream.make_client(state.settings.upstream_connections)
    yield
    await pool.close()


async def _telemetry(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    metrics = m.make_metrics()
    m.export_native(metrics, native.loaded())
    log.info("%s", native.describe())
    spans = make_spans(state.settings.traces, state.settings.span_export_nice)
    state.metrics, state.spans = metrics, spans
    if spans is not None:
        await spans.start()
        _watch_spans(metrics, spans)
    # Several workers: another worker may answer the scrape, so this one's figures must reach the shared files.
    folding = asyncio.get_running_loop().create_task(_fold_every(metrics)) if m.multiprocess_dir() else None
    yield
    if folding is not None:
        folding.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await folding
        metrics.fold()
    if spans is not None:
        await spans.close()  # exports what is still queued


async def _fold_every(metrics: m.Metrics) -> None:
    while True:
        await asyncio.sleep(m.FOLD_S)
        metrics.fold()


def _watch_spans(metrics: m.Metrics, spans: Spans) -> None:
    """Spans exported and spans dropped (the batch processor's own counts, read at scrape)."""
    processor = spans.processor
    if isinstance(processor, (BoundedBatches, ExportProcess)):
        m.watch(metrics, m.SPANS_EXPORTED, lambda: processor.exported)
        m.watch(metrics, m.SPANS_DROPPED, lambda: processor.dropped)


async def _policy(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    settings, metrics = state.settings, state.metrics
    state.policy_file = policy_file = PolicyFile(settings.policy, on_reload=lambda new, err: _reloaded(app, new, err))
    metrics.policy_valid.set(1)
    watcher = asyncio.get_running_loop().create_task(policy_file.watch(settings.policy_poll_s))
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, policy_file.reload)
    yield
    watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher


def _reloaded(app: web.Application, new: Policy | None, err: PolicyError | None) -> None:
    state = app[STATE]
    metrics = state.metrics
    metrics.policy_reloads.labels("ok" if err is None else "invalid").inc()
    metrics.policy_valid.set(0 if err is not None else 1)
    if new is not None and hasattr(state, "deployments"):
        state.deployments.reconcile(new)


PROBE_CONNECTIONS = 2  # per deployment: its /health probe and /metrics scrape run one after the other


async def _deployments(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    settings, metrics = state.settings, state.metrics
    # Probes and scrapes get their own small pool: the main pool at its limit under load must not fail
    # them and make a busy, healthy deployment look dead.
    probes = upstream.make_client(PROBE_CONNECTIONS)
    board = None
    if settings.workers > 1 and settings.run_dir:  # one prober, failures and in-flight counted across workers
        board = Board(os.path.join(settings.run_dir, "board"), settings.worker_index)
    deployments = Deployments(probes, on_change=lambda name, tracked: _export_load(metrics, name, tracked,
                                                                                   deployments), board=board)
    state.deployments = deployments
    state.counts = DeploymentCounts(state.pool, lambda name, outcome: metrics.deployment_counts.labels(name, outcome)
                                   .inc())
    deployments.reconcile(state.policy_file.current)
    yield
    await deployments.close()
    await probes.close()


def _export_load(metrics: m.Metrics, name: str, tracked: Tracked, deployments: Deployments) -> None:
    load = tracked.load
    metrics.in_flight.labels(name).set(deployments.in_flight.get(name, 0))
    metrics.deployment_healthy.labels(name).set(1 if load.healthy else 0)
    metrics.deployment_waiting.labels(name).set(load.requests_waiting)
    metrics.deployment_running.labels(name).set(load.requests_running)
    metrics.deployment_kv_cache.labels(name).set(load.kv_cache_usage)
    if tracked.window is not None:
        metrics.deployment_window.labels(name).set(tracked.window)
    spec = tracked.spec_decode
    if spec is not None:
        metrics.spec_decode.by_deployment[name] = (spec.drafts, spec.draft_tokens, spec.accepted_tokens)
        if spec.acceptance_ratio is not None:
            metrics.deployment_spec_acceptance.labels(name).set(spec.acceptance_ratio)


async def _classifier(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    path = state.settings.classifier_model
    state.classifier = Classifier.load(path) if path else Classifier.default()
    load_encoding()  # tiktoken's table takes ~0.4 s to build: not on the first request's event-loop turn
    yield


async def _stores(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    state.stores = stores = open_stores(state.policy_file.current.store, state.settings.redis_url)
    yield
    await stores.close()


async def _offload(app: web.Application) -> AsyncIterator[None]:
    """The object store of masked tool outputs, opened from the policy's `store.objects` at start (like the
    other stores, a reload does not move it)."""
    state = app[STATE]
    section = state.policy_file.current.store.objects
    default_dir = state.settings.objects_dir or os.path.join(tempfile.gettempdir(), "agent-gateway-objects")
    store = open_objects(section, default_dir)
    if isinstance(store, DiskObjects):
        await store.open()
    state.offload = Offload(store, state.metrics, section.ttl_s)
    state.library = library = Library(store, state.metrics)
    yield
    await library.close()
    await store.close()


async def _conversations(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    state.conversations = Conversations(state.stores.responses)
    yield


async def _session_caches(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    state.session_caches = caches = SessionCaches(state.stores.prefixes, state.metrics)
    state.warmups = warmups = Warmups(state.pool, state.deployments, state.stores.prefixes, state.metrics,
                                     state.accounting.budgets)
    state.evictions = evictions = Evictions(state.pool, state.settings.max_upstream_body_bytes, state.offload.store,
                                            state.library, state.metrics, state.accounting.budgets)
    yield
    await evictions.close()
    await warmups.close()  # before the pool and the stores close
    await caches.close()


async def _shares(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    stores, policy_file = state.stores, state.policy_file
    state.shares = tracker = ShareTracker(shared=stores.shared)
    tracker.follow(policy_file.current)
    if not stores.shared:  # one process: its own window is the whole truth, nothing to exchange
        yield
        return
    task = asyncio.get_running_loop().create_task(
        keep_in_step(tracker, stores.shares, lambda: policy_file.current))
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _accounting(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    store, metrics = state.stores.accounting, state.metrics
    state.accounting = Accounting(store, state.policy_file.current)
    fallback = store if isinstance(store, FallbackStore) else None
    m.watch(metrics, m.STORE_DEGRADED, lambda: float(fallback is not None and fallback.degraded))
    m.watch(metrics, m.STORE_PENDING_SETTLES, lambda: float(fallback.pending_settles if fallback else 0))
    m.watch(metrics, m.STORE_DROPPED_SETTLES, lambda: float(fallback.dropped_settles if fallback else 0))
    yield


async def _experiments(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    settings, metrics, policy_file = state.settings, state.metrics, state.policy_file
    rollouts = Rollouts(state.stores.rollouts, lambda: policy_file.current, metrics)
    # Labels keep prompts only with the request log's own opt-in (AGENT_GATEWAY_REQUEST_LOG_PROMPTS=1).
    labeller = Labeller(state.pool, state.stores.labels, metrics, lambda: policy_file.current,
                        prompts=bool(settings.request_log_prompts))
    shadows = Shadows(state.pool, state.stores.pairs, metrics, on_outcome=rollouts.counters.record_outcome,
                      on_pair=labeller.offer, spans=lambda: state.spans)
    request_log = None
    if settings.request_log:
        request_log = RequestLog(settings.request_log, prompts=bool(settings.request_log_prompts))
        request_log.start()
    state.experiments = Experiments(rollouts, shadows, metrics, request_log, state.classifier)
    rollouts.start_tasks()
    yield
    await shadows.close()
    await labeller.close()
    await rollouts.close()
    if request_log is not None:
        await request_log.close()


async def _trajectories(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    settings, policy_file = state.settings, state.policy_file
    trajectories = Trajectories(state.stores.trajectories, lambda: policy_file.current, state.metrics,
                                state.experiments.cohort_counters.record_process,
                                keep_text=bool(settings.request_log_prompts))
    state.trajectories = trajectories
    trajectories.start()
    yield
    await trajectories.close()  # before the rollouts flush (their process counters) and the spans close


GC_YOUNG_THRESHOLD = 10_000  # allocations between young-generation collections (CPython's default: 700)


async def _long_lived_heap(app: web.Application) -> AsyncIterator[None]:
    # The classifier's tables, tiktoken's ranks and the policy are long-lived: keep them out of the
    # cyclic collector, whose full passes over them would otherwise stall requests now and then.
    gc.collect()
    gc.freeze()
    # Each young-generation pass walks every live object of the requests in flight, however few allocations
    # came before it, so at CPython's default threshold the passes are frequent and each walks much the same
    # objects again. At GC_YOUNG_THRESHOLD a pass runs far less often and takes longer, and the collector costs
    # less CPU per request in all (docs/performance.md, 'Why the code is shaped so').
    gc.set_threshold(GC_YOUNG_THRESHOLD, 10, 10)
    yield
