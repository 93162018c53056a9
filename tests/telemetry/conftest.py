"""The telemetry tests' collector: the benchmark's trace sink, which counts the spans of every OTLP request."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from fakes import trace_sink


@pytest.fixture
async def counting_sink(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[list[int]]:
    """The trace sink on a free port, named by OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; yields its one-item count."""
    sink = web.Application()
    sink[trace_sink.SPANS] = [0]
    sink.router.add_post("/v1/traces", trace_sink.traces)
    server = TestServer(sink, host="127.0.0.1")
    await server.start_server()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{server.port}/v1/traces")
    yield sink[trace_sink.SPANS]
    await server.close()
