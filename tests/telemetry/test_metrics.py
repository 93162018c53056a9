"""One span per request with GenAI attributes; Prometheus series for requests, latency, TTFT, tokens."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased

from fakes.faulty_vllm import Fault
from gateway.apis.usage import Usage
from gateway.server.resources import STATE
from gateway.server.settings import Settings
from gateway.telemetry.export_process import ExportProcess
from gateway.telemetry.metrics import FOLD_EVERY, BatchedCounts, make_metrics
from gateway.telemetry.spans import BoundedBatches, Spans, make_spans
from tests.fixtures.conditions import until
from tests.fixtures.stack import Stack
from tests.server.test_proxy import _ready_status

HELLO = [{"role": "user", "content": "hi"}]


def _capture(stack: Stack) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    stack.gateway.app[STATE].spans = Spans(SimpleSpanProcessor(exporter))
    return exporter


async def test_span_carries_decision_models_tokens_and_ttft(stack: Stack) -> None:
    exporter = _capture(stack)
    async with stack.client() as client:
        stream = await client.chat.completions.create(
            model="auto", messages=HELLO, stream=True, max_tokens=20, temperature=0.0,
            extra_headers={"x-priority": "high"})
        async for _ in stream:
            pass
    (span,) = exporter.get_finished_spans()
    attrs = dict(span.attributes or {})
    assert span.name == "gateway chat"
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == "auto"
    assert attrs["gen_ai.response.model"] == "fake-hq"
    assert attrs["gen_ai.request.max_tokens"] == 20
    assert attrs["gen_ai.usage.input_tokens"] == 11 and attrs["gen_ai.usage.output_tokens"] == 8
    assert attrs["gateway.deployment"] == "hq" and attrs["gateway.rule"] == "priority-header"
    assert "rule priority-header: matched, use hq" in attrs["gateway.reasons"]
    assert float(attrs["gateway.ttft_ms"]) > 0
    assert attrs["http.response.status_code"] == 200


async def test_span_records_what_happened_not_what_was_planned(stack: Stack) -> None:
    """The deployments actually tried and the model the answer named, not the decision's plan."""
    exporter = _capture(stack)
    stack.hq.answer_model = "fake-hq-2024-06-01"  # the model vLLM names in its answers
    stack.fast.faults.append(Fault(status=503))
    async with stack.client() as client:
        await client.chat.completions.create(model="auto", messages=HELLO)  # fast fails, hq answers
        await client.chat.completions.create(model="auto", messages=HELLO)  # planned fast then hq; fast answers
        stream = await client.chat.completions.create(model="hq", messages=HELLO, stream=True)
        async for _ in stream:
            pass
    failed_over, direct, streamed = (dict(s.attributes or {}) for s in exporter.get_finished_spans())
    assert failed_over["gateway.attempts"] == ("fast", "hq") and failed_over["gateway.deployment"] == "hq"
    assert failed_over["gen_ai.response.model"] == "fake-hq-2024-06-01"
    assert direct["gateway.attempts"] == ("fast",) and direct["gen_ai.response.model"] == "fake-fast"
    assert streamed["gateway.attempts"] == ("hq",) and streamed["gen_ai.response.model"] == "fake-hq-2024-06-01"


CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


def _traceparent_sent(stack: Stack) -> str:
    return {k.lower(): v for k, v in stack.fast.headers_seen[-1].items()}["traceparent"]


async def test_the_callers_trace_continues_through_the_gateway_to_the_deployment(stack: Stack) -> None:
    exporter = _capture(stack)
    async with stack.client() as client:
        await client.chat.completions.create(model="auto", messages=HELLO, extra_headers={
            "traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01", "tracestate": "vendor=x"})
    (span,) = exporter.get_finished_spans()
    assert f"{span.context.trace_id:032x}" == CALLER_TRACE
    assert span.parent is not None and f"{span.parent.span_id:016x}" == CALLER_SPAN
    # the deployment's work is a child of the gateway's span, in the caller's trace
    assert _traceparent_sent(stack) == f"00-{CALLER_TRACE}-{span.context.span_id:016x}-01"
    assert {k.lower(): v for k, v in stack.fast.headers_seen[-1].items()}["tracestate"] == "vendor=x"


@pytest.mark.parametrize("header", [None, "garbage", f"ff-{CALLER_TRACE}-{CALLER_SPAN}-01",
                                    f"00-{'0' * 32}-{CALLER_SPAN}-01", f"00-{CALLER_TRACE}-{CALLER_SPAN}-01-extra"])
async def test_without_a_valid_traceparent_the_gateway_starts_the_trace(stack: Stack, header: str | None) -> None:
    exporter = _capture(stack)
    async with stack.client() as client:
        await client.chat.completions.create(
            model="auto", messages=HELLO, extra_headers={"traceparent": header} if header else None)
    (span,) = exporter.get_finished_spans()
    assert span.parent is None and f"{span.context.trace_id:032x}" != CALLER_TRACE
    assert _traceparent_sent(stack) == f"00-{span.context.trace_id:032x}-{span.context.span_id:016x}-01"


async def test_with_spans_off_the_callers_traceparent_goes_upstream_as_sent(stack: Stack) -> None:
    stack.gateway.app[STATE].spans = None
    sent = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
    async with stack.client() as client:
        await client.chat.completions.create(model="auto", messages=HELLO, extra_headers={"traceparent": sent})
    assert _traceparent_sent(stack) == sent


SHADOW_TO_HQ = """
    shadows:
      - route: fast
        target: deployment:hq
        percent: 100
        sample_by: random
"""


async def test_a_shadow_is_a_span_in_the_callers_trace_and_the_parent_of_its_deployments(make_stack: Any) -> None:
    stack: Stack = await make_stack(SHADOW_TO_HQ)
    exporter = _capture(stack)
    async with stack.client() as client:
        await client.chat.completions.create(model="fast", messages=HELLO, extra_headers={
            "traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"})
    await until(lambda: len(exporter.get_finished_spans()) == 2, what="the request's span and the shadow's")
    by_name = {span.name: span for span in exporter.get_finished_spans()}
    request, shadow = by_name["gateway chat"], by_name["shadow deployment:hq"]
    assert shadow.parent is not None and shadow.parent.span_id == request.context.span_id
    assert f"{shadow.context.trace_id:032x}" == CALLER_TRACE and shadow.kind.name == "CLIENT"
    attrs = dict(shadow.attributes or {})
    assert attrs["gateway.shadow.target"] == "deployment:hq" and attrs["gateway.deployment"] == "hq"
    assert attrs["http.response.status_code"] == 200 and shadow.status.status_code.name == "UNSET"
    sent = {k.lower(): v for k, v in stack.hq.headers_seen[-1].items()}
    assert sent["x-gateway-shadow"] == "1"
    assert sent["traceparent"] == f"00-{CALLER_TRACE}-{shadow.context.span_id:016x}-01"
    stack.hq.faults.append(Fault(status=503))  # the next shadow fails: its span says so, the client's call does not
    async with stack.client() as client:
        await client.chat.completions.create(model="fast", messages=HELLO)
    await until(lambda: len(exporter.get_finished_spans()) == 4, what="the second request's spans")
    failed = [s for s in exporter.get_finished_spans()[2:] if s.name == "shadow deployment:hq"]
    assert len(failed) == 1 and failed[0].status.status_code.name == "ERROR"
    assert failed[0].status.description == "Deployment 'hq' answered 503"
    assert "http.response.status_code" not in dict(failed[0].attributes or {})  # no answer to read


async def test_with_spans_off_a_shadow_carries_the_callers_traceparent_as_sent(make_stack: Any) -> None:
    stack: Stack = await make_stack(SHADOW_TO_HQ)
    stack.gateway.app[STATE].spans = None
    sent = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
    async with stack.client() as client:
        await client.chat.completions.create(model="fast", messages=HELLO, extra_headers={
            "traceparent": sent, "tracestate": "vendor=x"})
    await until(lambda: bool(stack.hq.headers_seen), what="the shadow's call")
    seen = {k.lower(): v for k, v in stack.hq.headers_seen[-1].items()}
    assert seen["traceparent"] == sent and seen["tracestate"] == "vendor=x"


def test_a_parent_based_sampler_follows_the_callers_sampled_flag() -> None:
    exporter = InMemorySpanExporter()
    spans = Spans(SimpleSpanProcessor(exporter), sampler=ParentBased(ALWAYS_ON))
    unsampled = spans.begin("gateway chat", {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-00"})
    sampled = spans.begin("gateway chat", {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"})
    sent: list[dict[str, str]] = [{}, {}]
    unsampled.inject(sent[0])
    sampled.inject(sent[1])
    assert sent[0]["traceparent"].endswith("-00") and sent[1]["traceparent"].endswith("-01")
    spans.record("gateway chat", 1, {}, trace=unsampled)
    spans.record("gateway chat", 1, {}, trace=sampled)
    assert [span.context.span_id for span in exporter.get_finished_spans()] == [sampled.span.span_id]


async def test_failed_request_span_is_an_error_and_secrets_stay_out(stack: Stack) -> None:
    exporter = _capture(stack)
    stack.fast.healthy = stack.hq.healthy = False
    await until(lambda: _ready_status(stack, 503), what="both deployments seen unhealthy")
    async with aiohttp.ClientSession() as http:
        async with http.post(stack.base_url + "/chat/completions", json={"model": "auto", "messages": HELLO},
                             headers={"Authorization": "Bearer sk-very-secret"}) as resp:
            assert resp.status == 503
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code.name == "ERROR"
    assert "sk-very-secret" not in str(span.to_json())


async def _metrics_text(stack: Stack) -> str:
    async with aiohttp.ClientSession() as http, http.get(stack.gateway.make_url("/metrics")) as resp:
        return await resp.text()


async def test_the_classifiers_time_is_counted_when_a_rule_reads_the_score(make_stack: Any) -> None:
    stack: Stack = await make_stack(rules="""
        rules:
          - name: hard-to-hq
            when: {complexity: {gte: 0.99}}
            use: hq
    """)
    async with stack.client() as client:
        for _ in range(3):
            await client.chat.completions.create(model="auto", messages=HELLO)
    text = await _metrics_text(stack)
    assert "gateway_classifier_scores_total 3.0" in text
    seconds = float(text.split("\ngateway_classifier_seconds_total ")[1].split()[0])
    assert 0 < seconds < 1


async def test_no_score_is_counted_when_no_rule_reads_it(stack: Stack) -> None:
    async with stack.client() as client:
        await client.chat.completions.create(model="auto", messages=HELLO)
    text = await _metrics_text(stack)
    assert "gateway_classifier_scores_total 0.0" in text and "gateway_classifier_seconds_total 0.0" in text


async def test_prometheus_series(stack: Stack) -> None:
    async with stack.client() as client:
        await client.chat.completions.create(model="hq", messages=HELLO)
        stream = await client.chat.completions.create(model="fast", messages=HELLO, stream=True)
        async for _ in stream:
            pass
    async with aiohttp.ClientSession() as http:
        async with http.get(stack.gateway.make_url("/metrics")) as resp:
            text = await resp.text()
    assert 'gateway_requests_total{deployment="hq",endpoint="chat",rule="pin:hq",status="200"} 1.0' in text
    assert 'gateway_time_to_first_token_seconds_count{deployment="fast"} 1.0' in text
    assert 'gateway_request_duration_seconds_count{deployment="hq",endpoint="chat"} 1.0' in text
    assert 'gateway_tokens_total{deployment="hq",direction="input"} 11.0' in text
    assert 'gateway_deployment_healthy{deployment="fast"} 1.0' in text
    assert 'gateway_deployment_kv_cache_usage_ratio{deployment="fast"} 0.1' in text


async def _metrics_with(stack: Stack, needle: str, timeout_s: float = 5.0) -> str:
    """The gateway's /metrics once it shows needle (it scrapes the deployments every 0.1 s)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while needle not in (text := await _metrics_text(stack)):
        assert asyncio.get_running_loop().time() < deadline, f"{needle} not in /metrics:\n{text}"
        await asyncio.sleep(0.05)
    return text


async def test_speculative_decoding_counts_and_acceptance_per_deployment(stack: Stack) -> None:
    stack.fast.spec_decode = (10.0, 40.0, 30.0)
    text = await _metrics_with(stack, 'gateway_deployment_spec_decode_drafts_total{deployment="fast"}')
    assert 'gateway_deployment_spec_decode_drafts_total{deployment="fast"} 10.0' in text
    assert 'gateway_deployment_spec_decode_draft_tokens_total{deployment="fast"} 40.0' in text
    assert 'gateway_deployment_spec_decode_accepted_tokens_total{deployment="fast"} 30.0' in text
    assert 'gateway_deployment_spec_decode_acceptance_ratio{deployment="fast"} 0.75' in text
    # hq does not speculate: no series for it at all (not a misleading 0).
    assert 'spec_decode_drafts_total{deployment="hq"}' not in text
    assert 'spec_decode_acceptance_ratio{deployment="hq"}' not in text


async def test_a_speculating_deployment_that_drafted_nothing_has_counts_but_no_ratio(stack: Stack) -> None:
    stack.fast.spec_decode = (0.0, 0.0, 0.0)
    text = await _metrics_with(stack, 'gateway_deployment_spec_decode_drafts_total{deployment="fast"} 0.0')
    assert "gateway_deployment_spec_decode_acceptance_ratio{" not in text


@pytest.fixture
async def collector() -> AsyncIterator[tuple[str, list[tuple[dict[str, str], bytes]]]]:
    """An OTLP/HTTP endpoint on a real aiohttp server that keeps each batch it is sent."""
    batches: list[tuple[dict[str, str], bytes]] = []

    async def traces(request: web.Request) -> web.Response:
        batches.append(({k.lower(): v for k, v in request.headers.items()}, await request.read()))
        answer = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=answer, content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield f"http://127.0.0.1:{server.port}/v1/traces", batches
    await server.close()


def _sent_spans(body: bytes) -> list[Any]:
    request = ExportTraceServiceRequest.FromString(body)
    return [span for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans]


async def test_otlp_export_sends_each_request_span_as_otlp_protobuf_through_the_sdk(  # type: ignore[no-untyped-def]
    make_stack: Any, collector, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint, batches = collector
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-collector-key=k%3Dv")
    stack: Stack = await make_stack(settings={"traces": "otlp"})
    async with stack.client() as client:
        for i in range(3):
            await client.chat.completions.create(model="auto", messages=HELLO, max_tokens=5, extra_headers={
                "traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"} if i == 0 else None)
    spans = stack.gateway.app[STATE].spans
    assert isinstance(spans.processor, ExportProcess)  # the SDK's processor and exporter, in a process of their own
    await until(lambda: spans.processor.handed == 3, what="the three spans recorded after their responses")
    # the batch is not full yet: the SDK's processor sends it now rather than after its delay
    assert await spans.processor.flush()
    async with aiohttp.ClientSession() as http, http.get(stack.gateway.make_url("/metrics")) as resp:
        exposition = await resp.text()
    assert "gateway_spans_exported 3.0" in exposition and "gateway_spans_dropped 0.0" in exposition
    assert batches, "no batch reached the collector"
    headers, body = batches[0]
    assert headers["content-type"] == "application/x-protobuf" and headers["x-collector-key"] == "k=v"
    sent = _sent_spans(body)
    assert len(sent) == 3 and len({span.trace_id for span in sent}) == 3
    (continued,) = [s for s in sent if s.trace_id.hex() == CALLER_TRACE]
    assert continued.parent_span_id.hex() == CALLER_SPAN
    span = sent[0]
    attrs = {kv.key: kv.value for kv in span.attributes}
    assert span.name == "gateway chat" and span.kind == span.SPAN_KIND_SERVER
    assert span.end_time_unix_nano > span.start_time_unix_nano
    assert attrs["gateway.deployment"].string_value == "fast"
    assert attrs["gen_ai.request.max_tokens"].int_value == 5
    assert attrs["http.response.status_code"].int_value == 200
    assert any("default" in v.string_value for v in attrs["gateway.reasons"].array_value.values)
    resource = {kv.key: kv.value.string_value
                for kv in ExportTraceServiceRequest.FromString(body).resource_spans[0].resource.attributes}
    assert resource["service.name"] == "agent-gateway"


async def test_the_bench_trace_sink_counts_what_the_sdk_exporter_sends(counting_sink: list[int]) -> None:
    spans = make_spans("otlp")
    assert spans is not None and isinstance(spans.processor, ExportProcess)
    await spans.start()
    try:
        for _ in range(5):
            spans.record("gateway chat", 1, {"k": "v"})
        assert await spans.processor.flush()
        assert counting_sink == [5]
    finally:
        await spans.close()


async def test_an_unreachable_collector_counts_the_batch_dropped_without_naming_its_secrets(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.fixtures.processes import free_port

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{free_port()}/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer sk-otel")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")  # seconds: the exporter's retries stop within it
    monkeypatch.setenv("AGENT_GATEWAY_LOG_LEVEL", "DEBUG")  # the export process logs all it has to say
    spans = make_spans("otlp")
    assert spans is not None and isinstance(spans.processor, ExportProcess)
    await spans.start()
    spans.record("gateway chat", 1, {"k": "v"})
    await spans.processor.flush()
    await spans.close()
    assert (spans.processor.exported, spans.processor.dropped) == (0, 1)
    logged = capfd.readouterr().err  # the export process writes its log to the gateway's stderr
    assert "Failed to export" in logged and "sk-otel" not in logged


class _HeldExporter(SpanExporter):
    """An exporter whose export waits until released, as a slow collector's answer does."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.exported: list[ReadableSpan] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.release.wait(timeout=30)
        self.exported.extend(spans)
        return SpanExportResult.SUCCESS


async def test_a_full_queue_drops_new_spans_and_counts_them() -> None:
    held = _HeldExporter()
    processor = BoundedBatches(held, max_queue=10, batch_size=4)
    spans = Spans(processor)
    try:
        for i in range(15):
            spans.record("gateway chat", 1, {"n": i})
        assert processor.dropped == 5
    finally:
        held.release.set()
        await spans.close()
    assert processor.counts.exported == 10 and sorted(s.attributes["n"] for s in held.exported) == list(range(10))


def test_the_queue_bound_is_the_sdks_queue_size(monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "1024")
    spans = make_spans("console")
    assert spans is not None and isinstance(spans.processor, BoundedBatches)
    assert spans.processor.max_queue == 1024
    assert spans.processor.batch_size == 1024  # the default batch, 2048, does not outgrow the queue
    spans.processor.shutdown()
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "-5")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "300")
    spans = make_spans("console")
    assert spans is not None and isinstance(spans.processor, BoundedBatches)
    assert (spans.processor.max_queue, spans.processor.batch_size) == (4096, 300)
    assert "OTEL_BSP_MAX_QUEUE_SIZE='-5' is not a positive whole number" in caplog.text
    spans.processor.shutdown()


def test_spans_are_exported_in_large_batches_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each export stalls the loop a moment: the SDK's 512-span batches were the c=1 p99 on small chat."""
    monkeypatch.delenv("OTEL_BSP_MAX_QUEUE_SIZE", raising=False)
    monkeypatch.delenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", raising=False)
    spans = make_spans("console")
    assert spans is not None and isinstance(spans.processor, BoundedBatches)
    assert (spans.processor.max_queue, spans.processor.batch_size) == (4096, 2048)
    spans.processor.shutdown()


def _kept_in_memory() -> tuple[Spans, InMemorySpanExporter]:
    """The gateway's spans as make_spans builds them (resource, sampler from the environment), kept in memory."""
    spans = make_spans("console")
    assert spans is not None and isinstance(spans.processor, BoundedBatches)
    spans.processor.shutdown()
    exporter = InMemorySpanExporter()
    spans.processor = SimpleSpanProcessor(exporter)
    return spans, exporter


def test_a_batch_is_encoded_with_its_resource_hashed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK's encoder files each span under its resource, and a plain Resource hashes by dumping its attributes
    as JSON at every ask: the gateway's resource answers from the hash it made once, equal to the SDK's."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk import resources

    spans, exporter = _kept_in_memory()
    for _ in range(50):
        spans.record("gateway chat", 1, {"gateway.rule": "default"})
    finished = exporter.get_finished_spans()
    resource = finished[0].resource
    plain = resources.Resource(resource.attributes, resource.schema_url)
    assert resource == plain and hash(resource) == hash(plain)
    assert resource.attributes["service.name"] == "agent-gateway"
    dumped = []
    real_dumps = resources.dumps
    monkeypatch.setattr(resources, "dumps", lambda *a, **k: dumped.append(1) or real_dumps(*a, **k))
    request = encode_spans(finished)
    assert dumped == []  # 50 spans filed under one resource without dumping it again
    assert len(request.resource_spans) == 1 and len(request.resource_spans[0].scope_spans[0].spans) == 50


def test_a_sampler_from_the_environment_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    spans, exporter = _kept_in_memory()
    for _ in range(2000):
        spans.record("gateway chat", 1, {})
    assert 350 < len(exporter.get_finished_spans()) < 650
    # parent-based: a sampled caller's trace is always kept
    caller = {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}
    for _ in range(50):
        spans.record("gateway chat", 1, {}, trace=spans.begin("gateway chat", caller))
    assert sum(f"{s.context.trace_id:032x}" == CALLER_TRACE for s in exporter.get_finished_spans()) == 50


def test_an_unknown_trace_exporter_is_a_clear_settings_error() -> None:
    with pytest.raises(ValueError, match="AGENT_GATEWAY_TRACES='jaeger' is not one of none, console, otlp"):
        Settings.from_env({"AGENT_GATEWAY_TRACES": "jaeger"})


@pytest.mark.parametrize(("raw", "said"), [("-1", "=-1 is not between 0 and 19"), ("20", "=20 is not between 0 and 19"),
                                           ("low", "='low' is not a valid int")])
def test_a_span_export_niceness_out_of_range_is_a_clear_settings_error(raw: str, said: str) -> None:
    with pytest.raises(ValueError, match=f"^AGENT_GATEWAY_SPAN_EXPORT_NICE{said}$"):
        Settings.from_env({"AGENT_GATEWAY_SPAN_EXPORT_NICE": raw})


def test_spans_encode_to_otlp_with_the_error_status_and_typed_values() -> None:
    exporter = InMemorySpanExporter()
    spans = Spans(SimpleSpanProcessor(exporter))
    attributes = {"s": 'x "quoted"\n', "i": 3, "f": 0.5, "b": True, "a": ("p", "q"), "nan": float("nan"),
                  "one": 1, "true": True, "one.0": 1.0}
    spans.record("gateway chat", 5, attributes, error="boom")
    request = encode_spans(exporter.get_finished_spans())
    span = request.resource_spans[0].scope_spans[0].spans[0]
    assert span.status.code == span.status.STATUS_CODE_ERROR and span.status.message == "boom"
    values = {kv.key: kv.value for kv in span.attributes}
    assert (values["s"].string_value, values["i"].int_value, values["f"].double_value, values["b"].bool_value) == (
        'x "quoted"\n', 3, 0.5, True)
    assert math.isnan(values["nan"].double_value)
    assert [v.string_value for v in values["a"].array_value.values] == ["p", "q"]
    assert [values[k].WhichOneof("value") for k in ("one", "true", "one.0")] == ["int_value", "bool_value",
                                                                               "double_value"]


def test_request_figures_reach_prometheus_in_batches_and_at_every_scrape() -> None:
    metrics = make_metrics()
    for _ in range(3):
        metrics.observe_request("chat", "fast", "default", "200", 0.004, 0.001)
    metrics.count_tokens("fast", "acme", Usage(11, 8, cached_tokens=6), 0.25)
    metrics.count_tokens("fast", "acme", Usage(5, 1, cached_tokens=5, cached_overstated=True), 0.0)
    text = metrics.render().decode()
    assert 'gateway_requests_total{deployment="fast",endpoint="chat",rule="default",status="200"} 3.0' in text
    assert 'gateway_request_duration_seconds_bucket{deployment="fast",endpoint="chat",le="0.005"} 3.0' in text
    assert 'gateway_time_to_first_token_seconds_count{deployment="fast"} 3.0' in text
    assert 'gateway_tokens_total{deployment="fast",direction="output"} 9.0' in text
    assert 'gateway_tenant_tokens_total{direction="input",tenant="acme"} 16.0' in text
    assert 'gateway_cached_tokens_total{deployment="fast"} 11.0' in text
    assert 'gateway_usage_cached_overstated_total{deployment="fast"} 1.0' in text
    assert 'gateway_spend_usd_total{deployment="fast",tenant="acme"} 0.25' in text
    for _ in range(FOLD_EVERY):
        metrics.observe_request("chat", "hq", "default", "200", 0.5, None)
    assert not metrics.pending  # folded without a scrape
    assert metrics.requests.labels("chat", "hq", "default", "200")._value.get() == FOLD_EVERY


def test_a_fold_writes_what_one_observation_at_a_time_would() -> None:
    """A fold adds up its batch (one write per series touched): the exposition equals observe() per value."""
    values = [0.0, 0.001, 0.0011, 0.25, 0.3, 7.0, 120.0, 500.0, 0.001]  # bucket bounds, between them, above all
    folded, direct = make_metrics(), make_metrics()
    for i, value in enumerate(values):
        folded.observe_request("chat", "hq", "default", "200", value, value if i % 2 else None)
        folded.count_tokens("hq", "acme", Usage(3, 4, cached_tokens=2), 0.5)
        direct.requests.labels("chat", "hq", "default", "200").inc()
        direct.latency.labels("chat", "hq").observe(value)
        if i % 2:
            direct.ttft.labels("hq").observe(value)
        for child, amount in ((direct.tokens.labels("hq", "input"), 3), (direct.tokens.labels("hq", "output"), 4),
                              (direct.tenant_tokens.labels("acme", "input"), 3),
                              (direct.tenant_tokens.labels("acme", "output"), 4),
                              (direct.spend.labels("acme", "hq"), 0.5), (direct.cached_tokens.labels("hq"), 2),
                              (direct.cached_overstated.labels("hq"), 0)):
            child.inc(amount)

    def samples(text: str) -> list[str]:
        return sorted(line for line in text.splitlines() if line.startswith("gateway_") and "_created" not in line)

    assert samples(folded.render().decode()) == samples(direct.render().decode())


def test_batched_counts_reach_prometheus_only_when_applied_summed_and_each_observed() -> None:
    metrics = make_metrics()
    counts = BatchedCounts(metrics.caches)
    counts.add("predicted", "fast", "cached", by=100)
    counts.add("predicted", "fast", "cached", by=20)
    counts.add("switches", "hq", "fast")
    counts.observe("prediction_error", "fast", value=3)
    counts.observe("prediction_error", "fast", value=5000)
    predicted = metrics.caches.predicted.labels("fast", "cached")
    assert counts.pending and predicted._value.get() == 0  # nothing written before apply
    counts.apply()
    assert not counts.pending
    assert predicted._value.get() == 120
    assert metrics.caches.switches.labels("hq", "fast")._value.get() == 1
    error = metrics.caches.prediction_error.labels("fast")
    assert error._sum.get() == 5003 and [b.get() for b in error._buckets][:2] == [0, 1]  # 3 falls in (0, 16]
    counts.apply()  # applied once: a second apply adds nothing
    assert predicted._value.get() == 120
