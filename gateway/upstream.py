"""The only user of aiohttp's client: sends requests to deployments and maps its errors to GatewayErrors."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
from multidict import CIMultiDictProxy

from gateway.errors import UpstreamError, UpstreamTimeout
from gateway.policy import Deployment, Timeouts

# RFC 9110 hop-by-hop headers, plus what the gateway sets itself or must never pass on.
_NOT_FORWARDED = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
        "te", "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length",
        "authorization", "cookie", "accept-encoding", "x-api-key",
    }
)


def forwardable(headers: Mapping[str, str]) -> dict[str, str]:
    """Client headers that may go upstream: no hop-by-hop headers, no credentials."""
    return {k: v for k, v in headers.items() if k.lower() not in _NOT_FORWARDED}


def make_session(limit: int = 1024) -> aiohttp.ClientSession:
    """The process's one pooled client session (owned by create_app's cleanup context)."""
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=0, ttl_dns_cache=300, enable_cleanup_closed=True)
    # No session-wide timeout: each request carries its deployment's timeouts.
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)


class Reply:
    """An open response from a deployment, after its headers arrived."""

    def __init__(self, response: aiohttp.ClientResponse, deployment: str) -> None:
        self._response = response
        self.deployment = deployment
        self.status = response.status
        self.headers: CIMultiDictProxy[str] = response.headers

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _translate(exc, self.deployment) from exc
        finally:
            self._response.release()

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive; a broken or stalled stream raises a GatewayError."""
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _translate(exc, self.deployment) from exc

    def close(self) -> None:
        """Abort: drop the connection so the deployment stops generating."""
        self._response.close()

    def release(self) -> None:
        self._response.release()


async def send(
    session: aiohttp.ClientSession,
    name: str,
    deployment: Deployment,
    path: str,
    body: bytes,
    headers: Mapping[str, str],
) -> Reply:
    """POST to a deployment and wait for the response headers.

    A connection error, a timeout or a 5xx raises (the caller may fail over); any other status is the
    deployment's answer and is returned for the client to see.
    """
    timeout = _client_timeout(deployment.timeouts)
    request_headers = {**headers, "content-type": "application/json"}
    try:
        response = await session.post(deployment.url + path, data=body, headers=request_headers, timeout=timeout)
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise _translate(exc, name) from exc
    if response.status >= 500:
        detail = await _short_text(response)
        raise UpstreamError(f"Deployment {name!r} answered {response.status}{detail}", code="upstream_5xx")
    return Reply(response, name)


@functools.lru_cache(maxsize=64)
def _client_timeout(t: Timeouts) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=t.total_s, sock_connect=t.connect_s, sock_read=t.read_s)


async def _short_text(response: aiohttp.ClientResponse) -> str:
    try:
        text = (await asyncio.wait_for(response.content.read(300), 1.0)).decode("utf-8", "replace")
    except (TimeoutError, aiohttp.ClientError, OSError):
        text = ""
    finally:
        response.close()
    return f": {text.strip()[:200]}" if text.strip() else ""


async def get(session: aiohttp.ClientSession, url: str, timeout_s: float) -> tuple[int, bytes]:
    """A small GET (health checks, /metrics scrapes); errors raise UpstreamError/UpstreamTimeout."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            return response.status, await response.read()
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise _translate(exc, url) from exc


def _translate(exc: BaseException, name: str) -> UpstreamError | UpstreamTimeout:
    if isinstance(exc, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return UpstreamTimeout(f"Deployment {name!r} did not answer in time")
    if isinstance(exc, aiohttp.ClientConnectorError | ConnectionRefusedError):
        return UpstreamError(f"Cannot connect to deployment {name!r}", code="upstream_unreachable")
    if isinstance(exc, aiohttp.ClientPayloadError | aiohttp.ServerDisconnectedError):
        return UpstreamError(f"Deployment {name!r} closed the connection mid-response", code="upstream_disconnected")
    return UpstreamError(f"Deployment {name!r} failed: {type(exc).__name__}")


def reply_headers(reply: Reply) -> dict[str, Any]:
    content_type = reply.headers.get("content-type", "application/json")
    return {"content-type": content_type}
