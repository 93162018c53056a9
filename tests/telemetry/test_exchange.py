"""An exchange's end: taken when the middleware finishes it, recorded (metrics and span) once its response is out."""

from __future__ import annotations

import asyncio
import time

from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.telemetry.exchange import Exchange
from gateway.telemetry.metrics import make_metrics
from gateway.telemetry.spans import Spans


async def test_finish_records_after_the_loop_turns_with_the_end_it_was_given() -> None:
    exporter = InMemorySpanExporter()
    spans, metrics = Spans(SimpleSpanProcessor(exporter)), make_metrics()
    ex = Exchange("req-1", "chat", "chat", spans.begin("chat"))
    before_ns = time.time_ns()
    ex.finish(200, metrics, spans)
    after_ns = time.time_ns()
    # nothing yet: aiohttp writes the response after the middleware returns, and the client should not wait
    assert metrics.pending == [] and exporter.get_finished_spans() == ()
    await asyncio.sleep(0)  # one turn of the loop: what the response's write would take
    (span,) = exporter.get_finished_spans()
    # the end is when finish was called, not when it was recorded
    assert span.end_time is not None and before_ns <= span.end_time <= after_ns
    assert span.attributes is not None and span.attributes["http.response.status_code"] == 200
    ((endpoint, deployment, rule, status, elapsed_s, ttft_s),) = metrics.pending
    assert (endpoint, deployment, rule, status, ttft_s) == ("chat", "none", "none", "200", None)
    assert 0 <= elapsed_s <= (after_ns - ex.started_ns) / 1e9 + 0.01
