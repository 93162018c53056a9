"""Sends requests to deployments over the pooled client (upstream/client.py); maps its errors to GatewayErrors."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.apis import json_body
from gateway.errors import UpstreamError, UpstreamTimeout
from gateway.policy.model import Deployment, Timeouts
from gateway.upstream.client import ClientError, ConnectError, Disconnected, Pool, Response, release_heap

RELEASE_AFTER_BYTES = 4 * 1024 * 1024  # a refused body this large gives the freed heap back to the OS

log = logging.getLogger(__name__)

# RFC 9110 hop-by-hop headers, plus what the gateway sets itself or must never pass on.
_NOT_FORWARDED = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
        "te", "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length",
        "authorization", "cookie", "accept-encoding", "x-api-key",
    }
)


def forwardable(headers: Mapping[str, str]) -> dict[str, str]:
    """Client headers that may go upstream (names lower-cased): no hop-by-hop headers, no credentials."""
    out = {}
    for name, value in headers.items():  # a loop: a generator and a comprehension cost a frame a header more
        lowered = name.lower()
        if lowered not in _NOT_FORWARDED:
            out[lowered] = value
    return out


def make_client(limit: int = 1024) -> Pool:
    """The process's one pool of connections to deployments (owned by create_app's cleanup context)."""
    return Pool(limit=limit)


class Reply:
    """An open response from a deployment, after its headers arrived."""

    def __init__(self, response: Response, deployment: str) -> None:
        self._response = response
        self.deployment = deployment
        self.status = response.status
        self.headers: Mapping[str, str] = response.headers

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        except (TimeoutError, ClientError) as exc:
            raise _translate(exc, self.deployment) from exc

    async def read_object(self, limit: int) -> tuple[bytes, dict[str, Any]]:
        """The whole body, which must be one JSON object of at most `limit` bytes, else UpstreamError.

        One declared over the limit is refused before any of it is read.
        """
        declared = self.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            self.close()
            raise self._too_large(limit)
        raw, _ = await self._read_whole(limit, object_only=True)
        found = json_body.response_object(raw)
        if found is None:
            size = len(raw)
            del raw
            self._drop([], size)
            raise self._not_an_object()
        return raw, found

    async def read_bounded(self, limit: int) -> tuple[bytes, float | None]:
        """The whole body, of any kind (JSON, an event stream), but never past `limit` bytes (UpstreamError
        upstream_body_too_large, the connection dropped); with the perf_counter time its first byte came."""
        return await self._read_whole(limit, object_only=False)

    async def _read_whole(self, limit: int, *, object_only: bool) -> tuple[bytes, float | None]:
        """The body read piece by piece to its end, and when its first byte came; one over `limit` is refused at
        the limit (and, with `object_only`, one that does not start like a JSON object at its first byte), the
        connection dropped, so neither is ever held whole."""
        parts: list[bytes] = []
        size, first_at, started = 0, None, not object_only
        try:
            while (chunk := await self._response.next_chunk()) is not None:
                first_at = first_at or time.perf_counter()
                if not started and (text := chunk.lstrip(b" \t\r\n")):
                    if text[:1] != b"{":
                        raise self._not_an_object()
                    started = True
                size += len(chunk)
                if size > limit:
                    raise self._too_large(limit)
                parts.append(chunk)
        except (TimeoutError, ClientError) as exc:
            self._drop(parts, size)
            raise _translate(exc, self.deployment) from exc
        except (UpstreamError, asyncio.CancelledError):  # cancelled: its deadline passed, or its client left
            self._drop(parts, size)
            raise
        self.release()
        return b"".join(parts), first_at

    def _drop(self, parts: list[bytes], size: int) -> None:
        """Forget a refused body: the error's traceback keeps this frame a while, but not the bytes read."""
        parts.clear()
        self.close()
        if size >= RELEASE_AFTER_BYTES:
            release_heap()

    def _not_an_object(self) -> UpstreamError:
        return UpstreamError(f"Deployment {self.deployment!r} answered {self.status} with a body that is not a "
                             "JSON object", code="upstream_invalid_body")

    def _too_large(self, limit: int) -> UpstreamError:
        return UpstreamError(f"Deployment {self.deployment!r} answered with a body over {limit} bytes",
                             code="upstream_body_too_large")

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive; a broken or stalled stream raises a GatewayError."""
        try:
            async for chunk in self._response.iter_chunks():
                yield chunk
        except (TimeoutError, ClientError) as exc:
            raise _translate(exc, self.deployment) from exc

    def close(self) -> None:
        """Abort: drop the connection so the deployment stops generating."""
        self._response.close()

    def release(self) -> None:
        self._response.release()


async def send(
    client: Pool,
    name: str,
    deployment: Deployment,
    path: str,
    body: bytes,
    headers: Mapping[str, str],
    sent: Callable[[], None] | None = None,
    timeouts: Timeouts | None = None,
) -> Reply:
    """POST to a deployment and wait for the response headers (`timeouts`, else the deployment's own).

    A connection error, a timeout or a 5xx raises (the caller may fail over); any other status is the
    deployment's answer and is returned for the client to see.
    """
    t = timeouts or deployment.timeouts
    request_headers = {**headers, "content-type": "application/json"}
    try:
        response = await client.request("POST", deployment.url + path, body, request_headers,
                                        connect_s=t.connect_s, read_s=t.read_s, total_s=t.total_s, sent=sent)
    except (TimeoutError, ClientError) as exc:
        raise _translate(exc, name) from exc
    if response.status >= 500:
        # The body may name internal hosts, paths or stack traces: it goes to the log, never to the client.
        text = (await response.read_prefix(300, timeout_s=1.0)).decode("utf-8", "replace").strip()
        log.warning("deployment %s answered %d to request %s: %s", name, response.status,
                    headers.get("x-request-id", "?"), text[:200])
        raise UpstreamError(f"Deployment {name!r} answered {response.status}", code="upstream_5xx")
    return Reply(response, name)


@dataclass(frozen=True, slots=True)
class Fetched:
    """A side call's answer, read whole: status, body (at most the call's limit), and times from its start."""

    status: int
    body: bytes
    total_ms: float
    first_byte_ms: float | None  # None when the body was empty


async def fetch(
    client: Pool,
    name: str,
    deployment: Deployment,
    path: str,
    body: bytes,
    headers: Mapping[str, str],
    *,
    timeout_s: float,
    limit_bytes: int,
) -> Fetched:
    """One bounded call beside the request path (a shadow, the judge): one attempt, no failover, the
    deployment's timeouts capped by `timeout_s` and the whole call within it, its answer (JSON or a stream)
    read whole but never past `limit_bytes`, the same bound as the primary path's read.

    Raises UpstreamTimeout past `timeout_s`, UpstreamError upstream_body_too_large past the limit, and
    what send() raises (a 5xx, a connection error).
    """
    t = deployment.timeouts
    bounded = Timeouts(connect_s=min(t.connect_s, timeout_s), read_s=min(t.read_s, timeout_s), total_s=timeout_s)
    started = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            reply = await send(client, name, deployment, path, body, headers, timeouts=bounded)
            raw, first_at = await reply.read_bounded(limit_bytes)
    except TimeoutError as exc:
        raise UpstreamTimeout(f"Deployment {name!r} did not answer within {timeout_s:g} s") from exc
    first_ms = None if first_at is None else _ms(first_at - started)
    return Fetched(reply.status, raw, _ms(time.perf_counter() - started), first_ms)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


async def answer(reply: Reply, stream: bool, limit: int) -> tuple[bytes, dict[str, Any]] | None:
    """Check a reply before any of it reaches the client, while the caller may still fail over.

    A streamed 200 must be an event stream (None: relay it as it comes); any other answer must be one
    JSON object of at most `limit` bytes, returned read whole with its parse. Else UpstreamError.
    """
    if stream and reply.status == 200:
        kind = reply.headers.get("content-type", "")
        if not kind.startswith("text/event-stream"):
            reply.close()
            raise UpstreamError(f"Deployment {reply.deployment!r} answered a streamed call with {kind or 'no'} "
                                "content type, not an event stream", code="upstream_invalid_body")
        return None
    return await reply.read_object(limit)


async def get(client: Pool, url: str, timeout_s: float) -> tuple[int, bytes]:
    """A small GET (health checks, /metrics scrapes); errors raise UpstreamError/UpstreamTimeout."""
    try:
        response = await client.request("GET", url, connect_s=timeout_s, read_s=timeout_s, total_s=timeout_s)
        return response.status, await response.read()
    except (TimeoutError, ClientError) as exc:
        raise _translate(exc, url) from exc


async def post(client: Pool, url: str, body: bytes, timeout_s: float) -> tuple[int, bytes]:
    """A small JSON POST of the gateway's own (a /tokenize count); errors raise UpstreamError/UpstreamTimeout."""
    try:
        response = await client.request("POST", url, body, {"content-type": "application/json"},
                                         connect_s=timeout_s, read_s=timeout_s, total_s=timeout_s)
        return response.status, await response.read()
    except (TimeoutError, ClientError) as exc:
        raise _translate(exc, url) from exc


def _translate(exc: BaseException, name: str) -> UpstreamError:
    if isinstance(exc, TimeoutError):
        return UpstreamTimeout(f"Deployment {name!r} did not answer in time")
    if isinstance(exc, ConnectError):
        return UpstreamError(f"Cannot connect to deployment {name!r}", code="upstream_unreachable")
    if isinstance(exc, Disconnected):
        return UpstreamError(f"Deployment {name!r} closed the connection mid-response", code="upstream_disconnected")
    return UpstreamError(f"Deployment {name!r} failed: {type(exc).__name__}")


def reply_headers(reply: Reply) -> dict[str, Any]:
    content_type = reply.headers.get("content-type", "application/json")
    return {"content-type": content_type}
