"""A client that hangs up mid-stream is a client close (499), recorded once, with no traceback and no
second response."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.server.settings import Settings
from tests.fixtures.conditions import until
from tests.fixtures.stack import ADMIN_TOKEN, policy_yaml
from tests.upstream.test_client import raw_server, read_request

HELLO = [{"role": "user", "content": "hi"}]
EVENT = b'data: {"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [{"index": 0, "delta": ' \
        b'{"content": "tok "}, "finish_reason": null}]}\n\n'
HANG_UPS = 5


class Upstream:
    """A deployment that streams one event per `send()`: the test decides when each chunk leaves."""

    def __init__(self) -> None:
        self.writers: list[asyncio.StreamWriter] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n" + EVENT)
        self.writers.append(writer)
        await reader.read()  # until the gateway drops the connection


@pytest.fixture
async def upstream_gateway(
    gateway_server: Callable[[Settings], Any], tmp_path: Path
) -> AsyncIterator[tuple[Upstream, int]]:
    upstream = Upstream()
    async with raw_server(upstream.handle) as url:
        path = tmp_path / "policy.yaml"
        path.write_text(policy_yaml(url, url))
        request_log = str(tmp_path / "requests.jsonl")
        server = await gateway_server(Settings(policy=str(path), admin_token=ADMIN_TOKEN, request_log=request_log))
        assert server.port is not None
        yield upstream, server.port


async def _statuses(port: int) -> dict[str, float]:
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as resp:
        text = await resp.text()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("gateway_requests_total{"):
            status = line.split('status="', 1)[1].split('"', 1)[0]
            found[status] = found.get(status, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


async def _hang_up_as_a_chunk_arrives(upstream: Upstream, port: int) -> None:
    """Stream, read the first event, then hang up in the same instant the next chunk reaches the gateway:
    its event loop sees both at once, and writes that chunk to a client connection already closing."""
    loop = asyncio.get_running_loop()
    body = json.dumps({"model": "fast", "messages": HELLO, "stream": True}).encode()
    with socket.socket() as client:  # a plain socket: close() below is immediate, not a loop callback
        client.setblocking(False)
        await loop.sock_connect(client, ("127.0.0.1", port))
        await loop.sock_sendall(client, b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\n"
                                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                                % (len(body), body))
        received = b""
        while b"\n\n" not in received:
            received += await loop.sock_recv(client, 65536)
        upstream.writers[-1].write(EVENT)  # sent at once; no await between these two lines
    # leaving the block closed the client socket


async def test_a_client_hanging_up_as_a_chunk_is_written_is_a_499_once_without_a_traceback(
    upstream_gateway: tuple[Upstream, int], caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    upstream, port = upstream_gateway
    caplog.set_level(logging.DEBUG)
    for done in range(1, HANG_UPS + 1):
        await _hang_up_as_a_chunk_arrives(upstream, port)

        async def recorded(done: int = done) -> bool:
            return sum((await _statuses(port)).values()) >= done

        await until(recorded, what=f"{done} requests recorded")
    assert await _statuses(port) == {"499": HANG_UPS}
    # The request log (and a rollout's cohorts, which take the same status) saw client closes too.
    log_path = tmp_path / "requests.jsonl"
    await until(lambda: log_path.exists() and len(log_path.read_text().splitlines()) == HANG_UPS,
                what="the request log flushed")
    assert [json.loads(line)["status"] for line in log_path.read_text().splitlines()] == [499] * HANG_UPS
    tracebacks = [r.getMessage() for r in caplog.records if r.exc_info and r.levelno >= logging.WARNING]
    assert not tracebacks
