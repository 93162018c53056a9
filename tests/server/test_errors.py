"""Bad input gets the right status and an OpenAI error envelope; nothing leaks, nothing crashes."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai
import pytest

from tests.fixtures.stack import Stack

HELLO = [{"role": "user", "content": "hi"}]


async def _post(stack: Stack, body: bytes | str, path: str = "/chat/completions",
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any], Any]:
    data = body.encode() if isinstance(body, str) else body
    async with aiohttp.ClientSession() as http:
        async with http.post(stack.base_url + path, data=data,
                             headers={"content-type": "application/json", **(headers or {})}) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, await resp.json()


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ("{not json", 400, "not valid JSON"),
        ("[1, 2]", 400, "must be a JSON object"),
        ("[" * 100_000, 400, "nests arrays or objects too deeply"),
        ("", 400, "empty"),
        (b'{"model": "\xff"}', 400, "UTF-8"),
        (json.dumps({"messages": HELLO}), 400, "Missing required parameter: 'model'"),
        (json.dumps({"model": "auto"}), 400, "Missing required parameter: 'messages'"),
        (json.dumps({"model": "auto", "messages": []}), 400, "at least one message"),
        (json.dumps({"model": "auto", "messages": "hi"}), 400, "expected an array, got a string"),
        (json.dumps({"model": "auto", "messages": [{"content": "x"}]}), 400, "string 'role'"),
        (json.dumps({"model": 7, "messages": HELLO}), 400, "'model'"),
        (json.dumps({"model": "auto", "messages": HELLO, "max_tokens": "ten"}), 400, "'max_tokens'"),
        (json.dumps({"model": "auto", "messages": HELLO, "max_tokens": 0}), 400, "at least 1"),
        (json.dumps({"model": "auto", "messages": HELLO, "stream": "yes"}), 400, "'stream'"),
        (json.dumps({"model": "auto", "messages": HELLO, "temperature": True}), 400, "'temperature'"),
        (json.dumps({"model": "gpt-17", "messages": HELLO}), 404, "does not exist"),
    ],
)
async def test_bad_requests_get_openai_envelopes(stack: Stack, body: str | bytes, status: int, needle: str) -> None:
    got_status, headers, payload = await _post(stack, body)
    assert got_status == status
    error = payload["error"]
    assert needle in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in json.dumps(payload)
    assert headers["x-request-id"]
    assert stack.fast.received == [] and stack.hq.received == []


async def test_unknown_model_through_the_sdk(stack: Stack) -> None:
    async with stack.client() as client:
        with pytest.raises(openai.NotFoundError) as caught:
            await client.chat.completions.create(model="gpt-17", messages=HELLO)  # type: ignore[arg-type]
    assert caught.value.code == "model_not_found"
    assert "auto" in caught.value.message


async def test_body_over_the_limit_is_413(make_stack: Any) -> None:
    stack: Stack = await make_stack(settings={"max_body_bytes": 10_000})
    big = json.dumps({"model": "auto", "messages": [{"role": "user", "content": "x" * 20_000}]})
    status, _, payload = await _post(stack, big)
    assert status == 413
    assert "limit" in payload["error"]["message"]
    async with stack.client() as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="auto", messages=[{"role": "user", "content": "y" * 20_000}])
    assert caught.value.status_code == 413


async def test_unknown_path_and_method_are_enveloped(stack: Stack) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(stack.gateway.make_url("/v1/nope")) as resp:
            assert resp.status == 404
            assert (await resp.json())["error"]["code"] == "unknown_path"
        async with http.get(stack.gateway.make_url("/v1/chat/completions")) as resp:
            assert resp.status == 405
            assert "error" in await resp.json()


async def test_upstream_client_error_is_passed_through_not_failed_over(stack: Stack) -> None:
    from fakes.faulty_vllm import Fault

    stack.fast.faults.append(Fault(status=400))
    async with stack.client() as client:
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="auto", messages=HELLO)
    assert stack.hq.received == []


async def test_all_deployments_down_is_a_clean_502_or_503(make_stack: Any, fake_pair: Any) -> None:
    stack: Stack = await make_stack()
    _, hq_server, _, fast_server = fake_pair
    await hq_server.close()
    await fast_server.close()
    async with stack.client() as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="auto", messages=HELLO)
    assert caught.value.status_code in (502, 503)
    assert "Traceback" not in caught.value.message and "127.0.0.1" not in caught.value.message


async def _chunks(payload: bytes, size: int) -> Any:
    for start in range(0, len(payload), size):
        yield payload[start:start + size]
        await asyncio.sleep(0)


async def test_chunked_body_is_read_whole_and_bounded(make_stack: Any) -> None:
    stack: Stack = await make_stack(settings={"max_body_bytes": 10_000})
    whole = json.dumps({"model": "fast", "messages": [{"role": "user", "content": "y" * 3_000}]}).encode()
    async with aiohttp.ClientSession() as http:
        async with http.post(stack.base_url + "/chat/completions", data=_chunks(whole, 500),
                             headers={"content-type": "application/json"}) as resp:
            assert resp.status == 200, await resp.text()
        too_big = json.dumps({"model": "fast", "messages": [{"role": "user", "content": "y" * 20_000}]}).encode()
        async with http.post(stack.base_url + "/chat/completions", data=_chunks(too_big, 500),
                             headers={"content-type": "application/json"}) as resp:
            assert resp.status == 413
    assert stack.fast.received[-1]["messages"][0]["content"] == "y" * 3_000


async def test_a_deployment_5xx_body_is_logged_not_shown_to_the_client(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    from fakes.faulty_vllm import Fault

    leak = "OOM on gpu-node-7.internal:/var/lib/models"
    stack.fast.faults.append(Fault(status=503, message=leak))
    stack.hq.faults.append(Fault(status=500, message=leak))
    async with stack.client() as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="auto", messages=HELLO)
    assert caught.value.status_code == 502 and caught.value.code == "upstream_5xx"
    assert "gpu-node-7" not in json.dumps(caught.value.body)
    assert any("gpu-node-7" in r.getMessage() for r in caplog.records)  # the operator still sees it
