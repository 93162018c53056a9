"""The span exporter in a process of its own: the SDK's batch processor and OTLP exporter, off the serving process.

The SDK's OTLP encoder is Python building protobuf messages, most of what a request span costs, in the processor's
thread: it holds the interpreter the event loop needs, so in-process export costs the serving process that CPU and
its loop a stall now and then, the tail of every request being served meanwhile (docs/telemetry.md has the
figures). `ExportProcess` is the span processor the serving process hands its spans to: it packs each finished span
into a tuple and sends them in frames over a pipe to `python -m gateway.telemetry.export_child`, which rebuilds
each as the SDK's `ReadableSpan` and hands it to the SDK's `BatchSpanProcessor` and OTLP/HTTP exporter, configured by
the same `OTEL_*` variables (it inherits the environment). The child reports what it exported and dropped on its
stdout, which the parent reads for `gateway_spans_exported` and `gateway_spans_dropped`.

The child runs at a lower priority (`nice`, AGENT_GATEWAY_SPAN_EXPORT_NICE, 10 by default): its exports come in
bursts (the SDK's batches of 512, encoded in one go), and where cores are short a burst at the serving process's
priority delays the requests being served, the c=1 tail most (docs/telemetry.md). Telemetry yields to requests:
on a host with no core to spare, the child falls behind, and what overflows its queue is dropped and counted.

Bounded the SDK's way: spans handed over and not yet reported exported or dropped are at most the queue's size
(`OTEL_BSP_MAX_QUEUE_SIZE`); a new span beyond it is dropped and counted. A child that dies loses (and counts) what
it held, and a new one is started on the next span, at most once a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
import sys
import time
from collections.abc import Sequence
from typing import Any

import msgspec

log = logging.getLogger(__name__)

FRAME_SPANS = 256  # spans in one frame, at most; fewer are sent after FRAME_DELAY_S
FRAME_DELAY_S = 0.2
RESTART_AFTER_S = 1.0
CLOSE_TIMEOUT_S = 15.0  # the child's last export, bounded by OTEL_EXPORTER_OTLP_TIMEOUT (10 s by default)
LENGTH = struct.Struct(">I")
SPANS, FLUSH = 0, 1  # a frame's kind: [0, [span, ...]] or [1, token]
NICE_ENV = "AGENT_GATEWAY_SPAN_EXPORT_NICE"  # the child's niceness, as the serving process's settings give it
DEFAULT_NICE = 10

# A span as the frame carries it: (name, trace id (16 bytes), span id, flags, trace state pairs, parent or None,
# kind, start ns, end ns, status code, status description, attributes, events); a parent is (trace id, span id,
# is_remote, flags), an event (name, attributes, time ns). The trace id is bytes: msgpack's integers stop at 64 bits.
Packed = tuple[Any, ...]


def pack(span: Any) -> Packed:
    """A finished `ReadableSpan` as the tuple a frame carries."""
    ctx, parent, status = span.context, span.parent, span.status
    up = None if parent is None else (parent.trace_id.to_bytes(16, "big"), parent.span_id, parent.is_remote,
                                      int(parent.trace_flags))
    return (span.name, ctx.trace_id.to_bytes(16, "big"), ctx.span_id, int(ctx.trace_flags),
            list(ctx.trace_state.items()) if ctx.trace_state else [], up, span.kind.value, span.start_time,
            span.end_time, status.status_code.value, status.description, dict(span.attributes or {}),
            [(e.name, dict(e.attributes or {}), e.timestamp) for e in span.events])


class ExportProcess:
    """The serving process's span processor: spans to the export child, its counts back."""

    def __init__(self, max_queue: int, argv: Sequence[str] | None = None, nice: int = DEFAULT_NICE) -> None:
        self.max_queue = max_queue
        self.nice = nice  # added to the serving process's niceness in the child
        self._argv = list(argv or (sys.executable, "-m", "gateway.telemetry.export_child"))
        self._encode = msgspec.msgpack.Encoder().encode
        self._pending: list[Packed] = []
        self._timer: asyncio.TimerHandle | None = None
        self._child: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._starting: asyncio.Task[None] | None = None
        self._started_at = -RESTART_AFTER_S
        self._closed = False
        self.handed = 0  # spans accepted from the event loop
        self.refused = 0  # dropped here: the queue was full
        self._past_exported = self._past_dropped = 0  # earlier children's final counts
        self._sent = 0  # spans written to the current child
        self._child_exported = self._child_dropped = 0  # the current child's reports
        self._flushed = 0  # the last flush token the child answered
        self._answered = asyncio.Event()

    @property
    def exported(self) -> int:
        return self._past_exported + self._child_exported

    @property
    def dropped(self) -> int:
        """Spans that never reached the collector: refused at the full queue, dropped or failed in the child, or
        lost with a child that died."""
        return self.refused + self._past_dropped + self._child_dropped

    async def start(self) -> bool:
        """Start the child (the serving app does, before its first request); False when it could not start."""
        await self._spawn()
        return self._child is not None

    def on_end(self, span: Any) -> None:
        """One finished span, from the event loop's thread."""
        settled = self.exported + self._past_dropped + self._child_dropped  # not those refused here: never handed
        if self._closed or self.handed - settled >= self.max_queue:
            self.refused += 1
            return
        self.handed += 1
        self._pending.append(pack(span))
        if len(self._pending) >= FRAME_SPANS:
            self._send()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(FRAME_DELAY_S, self._send)

    async def flush(self, timeout_s: float = 30.0) -> bool:
        """Send what is pending and wait until the child has exported (or dropped) everything it was sent; False
        when that did not happen within timeout_s."""
        try:
            async with asyncio.timeout(timeout_s):
                return await self._flush()
        except TimeoutError:
            return False

    async def _flush(self) -> bool:
        self._send()
        if self._starting is not None:  # a new child, which takes the pending spans once it runs
            await self._starting
        child = self._child
        if child is None or child.stdin is None:
            return not self._pending
        token = self._flushed + 1
        child.stdin.write(self._frame([FLUSH, token]))
        while self._flushed < token and self._child is child:
            self._answered.clear()
            await self._answered.wait()
        return self._flushed >= token

    async def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Send what is pending, let the child export it and end, within timeout_s (then it is killed)."""
        self._closed = True  # new spans are refused; no child is started after the one starting now
        if self._starting is not None:
            await self._starting
        self._send()
        child = self._child
        if child is None:  # none could be started: what was pending is lost
            self._past_dropped += len(self._pending)
            self._pending = []
            return
        if child.stdin is not None:
            child.stdin.close()
        try:
            async with asyncio.timeout(timeout_s):
                await child.wait()
                if self._reader is not None:
                    await self._reader
        except TimeoutError:
            log.warning("the span export process did not end within %g s; killed", timeout_s)
            with contextlib.suppress(ProcessLookupError):
                child.kill()
            await child.wait()

    def _send(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._pending:
            return
        child = self._child
        if child is None or child.stdin is None or child.returncode is not None or child.stdin.is_closing():
            self._respawn_later()
            return
        spans, self._pending = self._pending, []
        child.stdin.write(self._frame([SPANS, spans]))
        self._sent += len(spans)

    def _frame(self, message: list[Any]) -> bytes:
        payload = self._encode(message)
        return LENGTH.pack(len(payload)) + payload

    def _respawn_later(self) -> None:
        """No live child: start one (at most once per RESTART_AFTER_S); the pending spans wait for it."""
        if self._closed or self._starting is not None:
            return
        wait_s = self._started_at + RESTART_AFTER_S - time.monotonic()
        self._starting = asyncio.get_running_loop().create_task(self._spawn(max(wait_s, 0.0)))

    async def _spawn(self, after_s: float = 0.0) -> None:
        try:
            if after_s:
                await asyncio.sleep(after_s)
            self._started_at = time.monotonic()
            self._child = await asyncio.create_subprocess_exec(
                *self._argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                env={**os.environ, NICE_ENV: str(self.nice)})
            self._reader = asyncio.get_running_loop().create_task(self._read_reports(self._child))
        except OSError as exc:
            log.warning("the span export process could not start: %s", exc)
        finally:
            self._starting = None
        if self._pending:
            self._send()

    async def _read_reports(self, child: asyncio.subprocess.Process) -> None:
        assert child.stdout is not None
        while line := await child.stdout.readline():
            try:
                self._child_exported, self._child_dropped, self._flushed = (int(f) for f in line.split())
            except ValueError:  # not a report (a library printing): its counts come on the next line
                continue
            self._answered.set()
        await child.wait()
        self._retire(child)

    def _retire(self, child: asyncio.subprocess.Process) -> None:
        """The child ended: what it was sent and did not report is lost."""
        lost = self._sent - self._child_exported - self._child_dropped
        if lost > 0 or (child.returncode and not self._closed):
            log.warning("the span export process ended (exit %s); %d spans it held are lost", child.returncode,
                        max(lost, 0))
        self._past_exported += self._child_exported
        self._past_dropped += self._child_dropped + max(lost, 0)
        self._sent = self._child_exported = self._child_dropped = 0
        if self._child is child:
            self._child = None
        self._answered.set()
