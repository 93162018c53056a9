"""The middleware chain in its order: the exchange outermost (it counts the status the client got), the envelope
inside it (in the API's own format), tenant auth innermost (its 401 enveloped and counted like any error)."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from gateway.accounting import keys
from gateway.server.resources import STATE
from tests.fixtures.stack import Stack, metric

HELLO = [{"role": "user", "content": "hi"}]
MESSAGE = {"model": "fast", "max_tokens": 16, "messages": HELLO}


async def _post(stack: Stack, path: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, Any, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.post(stack.gateway.make_url(path), json=body, headers=headers) as resp:
            return resp.status, resp.headers, await resp.json()


@pytest.fixture
async def keyed(make_stack: Any) -> tuple[Stack, str]:
    stack: Stack = await make_stack("""
        auth: {enabled: true}
    """)
    _, raw = await keys.create(stack.gateway.app[STATE].accounting.store, "acme")
    return stack, raw


async def test_a_refused_key_is_the_apis_own_401_counted_by_the_exchange(keyed: tuple[Stack, str]) -> None:
    stack, _ = keyed
    status, headers, body = await _post(stack, "/v1/messages", MESSAGE, {"x-api-key": "agk-00000000-wrong"})
    assert status == 401 and headers["x-request-id"]
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"  # Anthropic's envelope
    status, _, body = await _post(stack, "/v1/chat/completions", {"model": "fast", "messages": HELLO}, {})
    assert status == 401 and body["error"]["type"] == "authentication_error" and "param" in body["error"]  # OpenAI's
    assert await metric(stack.gateway, "gateway_requests_total", endpoint="messages", status="401") == 1
    assert await metric(stack.gateway, "gateway_requests_total", endpoint="chat", status="401") == 1
    assert stack.fast.received == [] and stack.hq.received == []


@pytest.mark.parametrize("header", ["authorization", "x-api-key"])
async def test_the_key_names_the_tenant_as_a_bearer_or_as_x_api_key(keyed: tuple[Stack, str], header: str) -> None:
    stack, raw = keyed
    given = {header: f"Bearer {raw}" if header == "authorization" else raw}
    status, _, body = await _post(stack, "/v1/messages", MESSAGE, given)
    assert status == 200, body
    async with aiohttp.ClientSession() as http:
        async with http.get(stack.gateway.make_url("/admin/usage?tenant=acme"),
                            headers={"authorization": "Bearer test-admin-token"}) as resp:
            usage = await resp.json()
    assert {row["tenant"] for row in usage["data"]} == {"acme"}


async def test_an_unexpected_error_is_a_500_quoting_the_request_id(stack: Stack, monkeypatch: Any) -> None:
    from gateway.server import pipeline

    async def broken(*_: Any) -> Any:
        raise RuntimeError("a bug, with internals /srv/secret")

    monkeypatch.setattr(pipeline, "read", broken)
    status, headers, body = await _post(stack, "/v1/chat/completions", {"model": "fast", "messages": HELLO}, {})
    assert status == 500 and headers["x-request-id"] in body["error"]["message"]
    assert "/srv/secret" not in body["error"]["message"]
    assert await metric(stack.gateway, "gateway_requests_total", endpoint="chat", status="500") == 1
