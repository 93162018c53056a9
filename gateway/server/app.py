"""create_app(settings): resources (cleanup_ctx), the middleware and the routes."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from collections.abc import AsyncIterator

from aiohttp import web
from prometheus_client import Gauge

from gateway.accounting import ledger as accounting
from gateway.classifier.scoring import Classifier
from gateway.experiments import runtime as trials
from gateway.features import load_encoding
from gateway.policy.file import PolicyFile
from gateway.policy.model import Policy, PolicyError
from gateway.server import admin, proxy, rollout_admin
from gateway.server.exchange import SERVICES, Recent, Services
from gateway.server.middleware import exchange_middleware
from gateway.settings import Settings
from gateway.telemetry.metrics import Metrics, make_metrics
from gateway.telemetry.spans import LoopExport, Spans, make_spans
from gateway.upstream import forward as upstream
from gateway.upstream.deployments import Backends, Tracked

log = logging.getLogger(__name__)


def create_app(settings: Settings) -> web.Application:
    # The body limit is enforced by proxy.read_body with a clear message; aiohttp's own cap sits above it.
    app = web.Application(middlewares=[exchange_middleware], client_max_size=settings.max_body_bytes + 1)
    app.cleanup_ctx.append(_services(settings))
    app.cleanup_ctx.append(accounting.lifecycle(settings))  # after services: the store, keys, budgets
    app.cleanup_ctx.append(trials.lifecycle(settings))  # after services: rollouts, shadows, request log
    app.router.add_post("/v1/chat/completions", proxy.chat_completions)
    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_post("/v1/embeddings", proxy.embeddings)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/healthz", admin.healthz)
    app.router.add_get("/readyz", admin.readyz)
    app.router.add_get("/metrics", admin.metrics)
    admin.add_routes(app.router)
    rollout_admin.add_routes(app.router)
    return app


GC_YOUNG_THRESHOLD = 10_000  # allocations between young-generation collections (CPython's default: 700)


def _services(settings: Settings):  # type: ignore[no-untyped-def]
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        metrics = make_metrics()
        load_encoding()  # tiktoken's table takes ~0.4 s to build: not on the first request's event-loop turn
        client = upstream.make_client()
        spans = make_spans(settings.traces, client)
        backends = Backends(client, on_change=lambda name, tracked: _export_load(metrics, name, tracked, backends))
        policy_file = PolicyFile(settings.policy, on_reload=lambda new, err: _reloaded(app, new, err))
        classifier = Classifier.load(settings.classifier_model) if settings.classifier_model else Classifier.default()
        app[SERVICES] = Services(settings, policy_file, backends, client, metrics, spans, classifier,
                                 Recent(settings.explain_memory))
        metrics.policy_valid.set(1)
        backends.reconcile(policy_file.current)
        # The classifier's tables, tiktoken's ranks and the policy are long-lived: keep them out of the
        # cyclic collector, whose full passes over them would otherwise stall requests now and then.
        gc.collect()
        gc.freeze()
        # Each young-generation pass walks every live object of the requests in flight (~0.7 ms at
        # concurrency 32 here) and the default threshold runs one every ~35 requests: ~25 µs per request.
        # At 10,000 a pass runs every ~1,000 requests and takes ~10 ms: ~10 µs per request.
        gc.set_threshold(GC_YOUNG_THRESHOLD, 10, 10)
        watcher = asyncio.get_running_loop().create_task(policy_file.watch(settings.policy_poll_s))
        if spans is not None:
            spans.start()
            _export_span_counts(metrics, spans)
        _on_sighup(policy_file)
        try:
            yield
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            await backends.close()
            if spans is not None:
                await spans.close()  # exports what is still queued, over the pool: before it closes
            await client.close()
    return ctx


def _export_span_counts(metrics: Metrics, spans: Spans) -> None:
    """Spans posted and spans dropped at the full queue (the loop exporter's own counts, read at scrape)."""
    processor = spans.processor
    if isinstance(processor, LoopExport):
        exported = Gauge("gateway_spans_exported", "Spans posted to the OTLP endpoint", registry=metrics.registry)
        exported.set_function(lambda: processor.exported)
        dropped = Gauge("gateway_spans_dropped", "Spans dropped: the export queue was full", registry=metrics.registry)
        dropped.set_function(lambda: processor.dropped)


def _on_sighup(policy_file: PolicyFile) -> None:
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, policy_file.reload)


def _reloaded(app: web.Application, new: Policy | None, err: PolicyError | None) -> None:
    svc = app[SERVICES]
    svc.metrics.policy_reloads.labels("ok" if err is None else "invalid").inc()
    svc.metrics.policy_valid.set(0 if err is not None else 1)
    if new is not None:
        svc.backends.reconcile(new)


def _export_load(metrics: Metrics, name: str, tracked: Tracked, backends: Backends) -> None:
    load = tracked.load
    metrics.in_flight.labels(name).set(backends.in_flight.get(name, 0))
    metrics.deployment_healthy.labels(name).set(1 if load.healthy else 0)
    metrics.deployment_waiting.labels(name).set(load.requests_waiting)
    metrics.deployment_running.labels(name).set(load.requests_running)
    metrics.deployment_kv_cache.labels(name).set(load.kv_cache_usage)
    if tracked.spec_acceptance is not None:
        metrics.deployment_spec_acceptance.labels(name).set(tracked.spec_acceptance)
