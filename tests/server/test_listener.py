"""What the gateway answers before a request reaches the app: slow heads, over-long headers, bytes that are
not HTTP. Every answer is the OpenAI envelope; a stuck client is cut off, not held."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from tests.fixtures.stack import Stack
from tests.fixtures.timers import armed_timers

HELLO = [{"role": "user", "content": "hi"}]


async def _raw(stack: Stack) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    port = stack.gateway.port
    assert port is not None
    return await asyncio.open_connection("127.0.0.1", port)


def _envelope(raw: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)["error"]


async def test_a_head_trickled_byte_by_byte_is_cut_off_with_408(make_stack: Any) -> None:
    stack: Stack = await make_stack(settings={"header_timeout_s": 0.5})
    reader, writer = await _raw(stack)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n" * 20

    async def trickle() -> None:
        for byte in head:  # about one byte every 20 ms: the head would take 30 s
            writer.write(bytes([byte]))
            await asyncio.sleep(0.02)

    trickling = asyncio.ensure_future(trickle())
    try:
        async with asyncio.timeout(15):  # without a head deadline: held until the 75 s keep-alive timeout
            answer = await reader.read()  # to EOF: the gateway closed the connection
    finally:
        trickling.cancel()
        writer.close()
    status, error = _envelope(answer)
    assert status == 408 and error["code"] == "request_timeout"


async def test_a_connection_that_sends_nothing_is_closed_after_the_head_deadline(make_stack: Any) -> None:
    stack: Stack = await make_stack(settings={"header_timeout_s": 0.3})
    reader, writer = await _raw(stack)
    try:
        async with asyncio.timeout(15):
            answer = await reader.read()
    finally:
        writer.close()
    assert _envelope(answer)[0] == 408


async def test_a_kept_alive_connection_serves_requests_after_the_head_deadline(make_stack: Any) -> None:
    """The head deadline is per request: an idle keep-alive connection is not cut off by it."""
    stack: Stack = await make_stack(settings={"header_timeout_s": 0.3})
    async with aiohttp.ClientSession() as http:
        for _ in range(2):
            async with http.post(stack.base_url + "/chat/completions", json={"model": "fast", "messages": HELLO}) as r:
                assert r.status == 200
            await asyncio.sleep(0.5)  # idle past the head deadline on the same connection (the behaviour tested)


async def test_an_over_long_header_gets_431_in_the_envelope(stack: Stack) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(stack.base_url + "/chat/completions", json={"model": "fast", "messages": HELLO},
                             headers={"x-session-id": "s" * 60_000}) as resp:
            assert resp.status == 431
            assert resp.content_type == "application/json"
            error = (await resp.json())["error"]
    assert error["code"] == "header_too_large" and set(error) == {"message", "type", "param", "code"}
    assert "sss" not in error["message"]
    assert stack.fast.received == []


async def test_bytes_that_are_not_http_get_400_in_the_envelope(stack: Stack) -> None:
    reader, writer = await _raw(stack)
    writer.write(b"GET / HTTP/1.1\r\nhost: x\r\nthis is not a header\r\n\r\n")
    try:
        async with asyncio.timeout(15):
            answer = await reader.read()
    finally:
        writer.close()
    status, error = _envelope(answer)
    assert status == 400 and error["code"] == "invalid_http_request"


async def test_requests_on_a_kept_alive_connection_arm_no_timer_each(make_stack: Any,
                                                                     monkeypatch: Any) -> None:
    """With uvloop a timer armed and cancelled costs ~7,600 instructions: neither the head deadline nor the
    upstream read deadline is armed per request on a kept-alive connection (gateway/upstream/deadline.py).
    The client here writes raw HTTP/1.1, so every timer counted is the gateway's or its fake deployment's."""
    stack: Stack = await make_stack()
    armed = armed_timers(asyncio.get_running_loop(), monkeypatch)
    reader, writer = await _raw(stack)
    body = json.dumps({"model": "fast", "messages": HELLO}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    try:
        for i in range(25):
            if i == 5:  # the connections' own deadlines and the pool's sweep are armed by now
                before = list(armed)
            writer.write(head + body)
            status_line = await reader.readline()
            assert status_line.startswith(b"HTTP/1.1 200"), status_line
            length = 0
            while (line := await reader.readline()) != b"\r\n":
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            await reader.readexactly(length)
    finally:
        writer.close()
    assert armed[len(before):] == []
