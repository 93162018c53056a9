"""The span export process's side (`python -m gateway.telemetry.export_child`): frames of spans from the serving
process's `ExportProcess` (export_process.py) on stdin, each span rebuilt as the SDK's `ReadableSpan` and handed to
the SDK's `BatchSpanProcessor` and OTLP/HTTP exporter; what they exported and dropped reported on stdout as
`exported dropped last-flush-answered` lines."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import IO, Any

import msgspec
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from gateway.telemetry.export_process import FLUSH, LENGTH, NICE_ENV, SPANS
from gateway.telemetry.spans import SCOPE, otlp_processor, resource

REPORT_EVERY_S = 0.25


class _Reporter:
    """Writes the child's counts (exported, dropped, last flush answered) to the parent when they change."""

    def __init__(self, processor: Any, out: IO[bytes]) -> None:
        self._processor, self._out = processor, out
        self._lock = threading.Lock()
        self._last: tuple[int, int, int] | None = None
        self.flushed = 0

    def report(self) -> None:
        with self._lock:
            now = (self._processor.counts.exported, self._processor.dropped, self.flushed)
            if now != self._last:
                self._out.write(b"%d %d %d\n" % now)
                self._out.flush()
                self._last = now

    def every(self, stop: threading.Event) -> None:
        while not stop.wait(REPORT_EVERY_S):
            self.report()


def unpack(packed: Sequence[Any], resource: Resource, scope: InstrumentationScope) -> ReadableSpan:
    """A span as export_process.pack packed it, rebuilt as the SDK's ReadableSpan."""
    (name, trace_id, span_id, flags, state, up, kind, start, end, code, description, attributes, events) = packed
    own = SpanContext(int.from_bytes(trace_id, "big"), span_id, is_remote=False, trace_flags=TraceFlags(flags),
                      trace_state=TraceState(list(map(tuple, state))))
    parent = None if up is None else SpanContext(int.from_bytes(up[0], "big"), up[1], is_remote=up[2],
                                                 trace_flags=TraceFlags(up[3]))
    return ReadableSpan(name, own, parent, resource, attributes, kind=SpanKind(kind),
                        status=Status(StatusCode(code), description), start_time=start, end_time=end,
                        events=[Event(e_name, e_attrs, at) for e_name, e_attrs, at in events],
                        instrumentation_scope=scope)


def read_frame(stream: IO[bytes]) -> bytes | None:
    head = stream.read(LENGTH.size)
    if len(head) < LENGTH.size:
        return None
    (length,) = LENGTH.unpack(head)
    body = stream.read(length)
    return body if len(body) == length else None


def _yield_to_requests(nice: str) -> None:
    """Lower this process's priority by `nice` (export_process.py says why); the serving process checked the value."""
    try:
        os.nice(int(nice or 0))
    except (ValueError, OSError) as exc:
        logging.getLogger(__name__).warning("%s=%r not applied: %s", NICE_ENV, nice, exc)


def main() -> int:
    """The child: frames from stdin to the SDK's batch processor and OTLP exporter until stdin ends."""
    # The serving process ends it by closing its stdin, once it sent its last spans: a signal to the process group
    # (Ctrl-C, a supervisor's SIGTERM) must not end it before those are exported.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=os.environ.get("AGENT_GATEWAY_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s (span export): %(message)s")
    _yield_to_requests(os.environ.get(NICE_ENV, ""))
    processor = otlp_processor()
    named = resource()
    reporter = _Reporter(processor, sys.stdout.buffer)
    stop = threading.Event()
    threading.Thread(target=reporter.every, args=(stop,), daemon=True).start()
    decode = msgspec.msgpack.Decoder().decode
    try:
        while (frame := read_frame(sys.stdin.buffer)) is not None:
            kind, body = decode(frame)
            if kind == SPANS:
                for packed in body:
                    processor.on_end(unpack(packed, named, SCOPE))
            elif kind == FLUSH:
                processor.force_flush()
                reporter.flushed = body
                reporter.report()
    finally:
        processor.shutdown()  # type: ignore[no-untyped-call]  # exports what is queued
        stop.set()
        reporter.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
