"""One span per request with GenAI attributes; Prometheus series for requests, latency, TTFT, tokens."""

from __future__ import annotations

import aiohttp
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.services import SERVICES
from tests.conftest import Stack

HELLO = [{"role": "user", "content": "hi"}]


def _capture(stack: Stack) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    stack.gateway.app[SERVICES].tracer = provider.get_tracer("test")
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


async def test_failed_request_span_is_an_error_and_secrets_stay_out(stack: Stack) -> None:
    exporter = _capture(stack)
    stack.fast.healthy = stack.hq.healthy = False
    import asyncio

    await asyncio.sleep(0.5)
    async with aiohttp.ClientSession() as http:
        async with http.post(stack.base_url + "/chat/completions", json={"model": "auto", "messages": HELLO},
                             headers={"Authorization": "Bearer sk-very-secret"}) as resp:
            assert resp.status == 503
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code.name == "ERROR"
    assert "sk-very-secret" not in str(span.to_json())


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
