"""An OTLP/HTTP trace receiver for benchmarks: accepts span batches (protobuf or JSON), counts spans, keeps nothing.

The gateway's benchmark runs with spans exported here, so "telemetry on" includes the span's creation and the
SDK's batching and protobuf encoding in the gateway process, not just metrics.
"""

from __future__ import annotations

import json
import sys

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

SPANS = web.AppKey("spans", list)
EMPTY_RESPONSE = ExportTraceServiceResponse().SerializeToString()


async def traces(request: web.Request) -> web.Response:
    """OTLP/HTTP in either encoding: protobuf (the SDK's exporter, the gateway's `otlp`) or JSON (other senders)."""
    raw = await request.read()
    if request.content_type == "application/json":
        batch = json.loads(raw)["resourceSpans"]
        request.app[SPANS][0] += sum(len(scope["spans"]) for rs in batch for scope in rs["scopeSpans"])
        return web.json_response({})
    message = ExportTraceServiceRequest.FromString(raw)
    request.app[SPANS][0] += sum(len(scope.spans) for rs in message.resource_spans for scope in rs.scope_spans)
    return web.Response(body=EMPTY_RESPONSE, content_type="application/x-protobuf")


async def count(request: web.Request) -> web.Response:
    return web.json_response({"spans": request.app[SPANS][0]})


def main() -> None:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[SPANS] = [0]
    app.router.add_post("/v1/traces", traces)
    app.router.add_get("/count", count)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)


if __name__ == "__main__":
    main()
