"""A deployment's answer is checked before any of it reaches the client: a 200 whose body is not a JSON
object (HTML, garbage, endless bytes) is a deployment failure, failed over or answered with a 502 envelope."""

from __future__ import annotations

import gc
import os
import tracemalloc
from typing import Any

import openai
import pytest
from multidict import CIMultiDict

from fakes.faulty_vllm import Fault
from gateway.upstream.forward import forwardable
from tests.fixtures.stack import Stack
from tests.server.test_proxy import _metric

HELLO = [{"role": "user", "content": "hi"}]
LIMIT = 64 * 1024

BAD_BODIES = {
    "html": Fault(body=b"<html><body><h1>502 Bad Gateway</h1></body></html>", content_type="text/html"),
    "garbage": Fault(body=os.urandom(4096)),
    "array": Fault(body=b"[1, 2, 3]"),
    "truncated json": Fault(body=b'{"id": "cmpl-1", "choices": ['),
    "over the limit": Fault(body=b'{"padding": "' + b"x" * (2 * LIMIT) + b'"}'),
    "endless, chunked": Fault(body=b"x" * 65536, repeat=800),  # 50 MiB with no Content-Length
    "endless json, chunked": Fault(body=b'{"id": "' + b"x" * 65536, repeat=800),
}


async def _failovers(stack: Stack, code: str) -> float:
    try:
        return await _metric(stack, f'gateway_failovers_total{{from_deployment="fast",reason="{code}"}}')
    except AssertionError:
        return 0.0


@pytest.mark.parametrize("kind", list(BAD_BODIES))
async def test_a_200_whose_body_is_not_a_json_object_fails_over(make_stack: Any, kind: str) -> None:
    stack: Stack = await make_stack(settings={"max_upstream_body_bytes": LIMIT})
    stack.fast.faults.append(BAD_BODIES[kind])
    async with stack.client() as client:
        raw = await client.chat.completions.with_raw_response.create(model="auto", messages=HELLO)
    assert raw.parse().model == "fake-hq"  # a parsed completion, not a str or a UnicodeDecodeError
    assert raw.headers["x-gateway-deployment"] == "hq"
    code = "upstream_body_too_large" if "limit" in kind or kind == "endless json, chunked" else "upstream_invalid_body"
    assert await _failovers(stack, code) == 1.0
    # Refused early (at the first byte, or at the limit): the rest was never read, the connection dropped.
    assert stack.fast.body_bytes_sent < 16 * 1024 * 1024


async def test_no_deployment_with_a_json_answer_is_a_502_envelope(stack: Stack) -> None:
    stack.fast.faults.append(BAD_BODIES["html"])
    stack.hq.faults.append(BAD_BODIES["garbage"])
    async with stack.client() as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="auto", messages=HELLO)
    assert caught.value.status_code == 502
    assert caught.value.code == "upstream_invalid_body"
    assert "<html>" not in caught.value.message


async def test_a_streamed_call_answered_with_a_page_not_an_event_stream_fails_over(stack: Stack) -> None:
    stack.fast.faults.append(BAD_BODIES["html"])
    async with stack.client() as client:
        stream = await client.chat.completions.create(model="auto", messages=HELLO, stream=True)
        models = {chunk.model async for chunk in stream}
    assert models == {"fake-hq"}


async def test_a_refused_body_is_not_kept_after_the_failover(make_stack: Any) -> None:
    """Bodies refused at the limit are dropped, not held by the error that failed them over (with the
    collector off, as between the gateway's rare collections, a cycle would keep each one)."""
    limit = 1024 * 1024
    stack: Stack = await make_stack(settings={"max_upstream_body_bytes": limit})
    async with stack.client() as client:
        await client.chat.completions.create(model="auto", messages=HELLO)  # warm
        gc.collect()
        gc.disable()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(5):
                stack.fast.faults.append(Fault(body=b'{"id": "' + b"x" * 65536, repeat=128))  # 8 MiB
                assert (await client.chat.completions.create(model="auto", messages=HELLO)).model == "fake-hq"
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
            gc.enable()
    assert grown < 2 * limit  # five bodies of a limit each were read and refused


def test_only_end_to_end_headers_without_credentials_go_upstream_lower_cased() -> None:
    client = CIMultiDict([("Authorization", "Bearer sk-tenant"), ("X-Api-Key", "k"), ("Cookie", "c=1"),
                          ("Connection", "keep-alive"), ("Host", "gw"), ("Content-Length", "12"),
                          ("Transfer-Encoding", "chunked"), ("Accept-Encoding", "gzip"), ("X-Session-Id", "s1"),
                          ("OpenAI-Beta", "assistants=v2"), ("traceparent", "00-ab-cd-01")])
    assert forwardable(client) == {"x-session-id": "s1", "openai-beta": "assistants=v2",
                                   "traceparent": "00-ab-cd-01"}
