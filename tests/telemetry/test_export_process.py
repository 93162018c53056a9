"""The span export process: spans cross the pipe unchanged, its counts come back, a dead one is replaced, and the
queue bound and the losses are counted as the in-process processor counts them."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import msgspec
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.trace import SpanKind

from gateway.telemetry.export_child import unpack
from gateway.telemetry.export_process import ExportProcess, pack
from gateway.telemetry.spans import SCOPE, BoundedBatches, Spans, make_spans, resource
from tests.fixtures.conditions import until

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


class _Kept:
    def __init__(self) -> None:
        self.spans: list[object] = []

    def on_end(self, span: object) -> None:
        self.spans.append(span)


def test_a_span_crosses_the_pipe_as_the_collector_would_have_received_it() -> None:
    """Packed, sent as msgpack and rebuilt, a span encodes to the very OTLP bytes it would have in process: ids,
    the caller's remote parent and tracestate, kind, times, error status, typed attributes and events."""
    spans = make_spans("console")
    assert spans is not None and isinstance(spans.processor, BoundedBatches)
    spans.processor.shutdown()
    kept = _Kept()
    spans.processor = kept
    caller = {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01", "tracestate": "vendor=abc,other=1"}
    trace = spans.begin("gateway chat", caller)
    attributes = {"gateway.rule": "default", "gateway.reasons": ("one", "two"), "gen_ai.request.max_tokens": 16,
                  "gateway.complexity": 0.25, "gateway.stream": True, "gateway.resumed_at_tokens": (3, 9)}
    spans.record("gateway chat", 1_000, attributes, "upstream failed", trace, end_ns=5_000,
                 events=[(2_000, "first byte", {"deployment": "fast"})], kind=SpanKind.SERVER)
    spans.record("gateway summary", 10, {}, None, spans.child(trace), end_ns=20, kind=SpanKind.CLIENT)
    named = resource()
    wire = msgspec.msgpack.Encoder().encode([pack(span) for span in kept.spans])
    rebuilt = [unpack(packed, named, SCOPE) for packed in msgspec.msgpack.Decoder().decode(wire)]
    originals = [_with_resource(span, named) for span in kept.spans]
    assert encode_spans(rebuilt).SerializeToString() == encode_spans(originals).SerializeToString()
    assert rebuilt[0].parent.is_remote and f"{rebuilt[0].parent.span_id:016x}" == CALLER_SPAN
    assert dict(rebuilt[0].context.trace_state) == {"vendor": "abc", "other": "1"}


def _with_resource(span: object, resource: object) -> object:
    """The span as the export process names its resource (one made there; equal to the serving process's)."""
    from opentelemetry.sdk.trace import ReadableSpan

    assert isinstance(span, ReadableSpan)
    return ReadableSpan(span.name, span.context, span.parent, resource, span.attributes, span.events, span.links,
                        span.kind, status=span.status, start_time=span.start_time, end_time=span.end_time,
                        instrumentation_scope=span.instrumentation_scope)


async def test_a_dead_export_process_is_replaced_and_what_it_held_is_counted_lost(counting_sink: list[int]) -> None:
    spans = make_spans("otlp")
    assert spans is not None and isinstance(spans.processor, ExportProcess)
    processor = spans.processor
    await spans.start()
    try:
        for _ in range(3):
            spans.record("gateway chat", 1, {"k": "v"})
        assert await processor.flush()
        assert (counting_sink[0], processor.exported, processor.dropped) == (3, 3, 0)
        first = _child_pid(processor)
        os.kill(first, signal.SIGKILL)
        await until(lambda: processor._child is None, what="the parent to see its export process end")
        for _ in range(2):
            spans.record("gateway chat", 1, {"k": "v"})
        assert await processor.flush()  # a new process, started for them
        assert _child_pid(processor) != first
        assert (counting_sink[0], processor.exported, processor.dropped) == (5, 5, 0)
    finally:
        await spans.close()


async def test_the_queue_bound_holds_and_a_stuck_export_process_is_killed_at_close() -> None:
    """A child that never reads: the spans it was sent count as lost once it is killed, the ones over the bound
    as refused; nothing waits past close's bound."""
    stuck = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                   "time.sleep(60)"]
    processor = ExportProcess(max_queue=10, argv=stuck)
    spans = Spans(processor)
    await spans.start()
    for i in range(15):
        spans.record("gateway chat", 1, {"n": i})
    assert (processor.handed, processor.refused) == (10, 5)
    await asyncio.wait_for(processor.close(timeout_s=1.0), 10.0)
    assert (processor.exported, processor.dropped) == (0, 15)
    spans.record("gateway chat", 1, {"n": 15})  # after close: refused, not sent anywhere
    assert processor.refused == 6


async def test_an_export_process_that_cannot_start_counts_its_spans_dropped(caplog: pytest.LogCaptureFixture) -> None:
    processor = ExportProcess(max_queue=10, argv=["/nonexistent/python"])
    assert not await processor.start()
    spans = Spans(processor)
    for i in range(3):
        spans.record("gateway chat", 1, {"n": i})
    await spans.close()
    assert (processor.handed, processor.exported, processor.dropped) == (3, 0, 3)
    assert "the span export process could not start" in caplog.text


async def test_where_no_export_process_can_start_spans_are_exported_in_process(
    counting_sink: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    spans = make_spans("otlp")
    assert spans is not None
    spans.processor = ExportProcess(max_queue=10, argv=["/nonexistent/python"])
    await spans.start()
    assert isinstance(spans.processor, BoundedBatches)  # the SDK's processor and OTLP exporter, here
    assert "spans are exported from the serving process" in caplog.text
    for i in range(3):
        spans.record("gateway chat", 1, {"n": i})
    assert await asyncio.to_thread(spans.processor.force_flush)
    await spans.close()
    assert counting_sink == [3] and (spans.processor.exported, spans.processor.dropped) == (3, 0)


@pytest.mark.parametrize("nice", [0, 7])
async def test_the_export_process_runs_at_the_lower_priority_it_is_given(counting_sink: list[int], nice: int) -> None:
    """Its bursts of encoding yield to the requests being served; what it exports is unchanged."""
    spans = make_spans("otlp", export_nice=nice)
    assert spans is not None and isinstance(spans.processor, ExportProcess)
    await spans.start()
    try:
        spans.record("gateway chat", 1, {"k": "v"})
        assert await spans.processor.flush()  # the child has read its niceness by now
        assert os.getpriority(os.PRIO_PROCESS, _child_pid(spans.processor)) == os.getpriority(os.PRIO_PROCESS, 0) + nice
        assert counting_sink == [1]
    finally:
        await spans.close()


def _child_pid(processor: ExportProcess) -> int:
    child = processor._child
    assert child is not None
    return child.pid
