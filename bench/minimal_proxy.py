"""The yardstick: a ~60-line aiohttp pass-through proxy with one pooled session, streaming relayed as-is."""

from __future__ import annotations

import sys

import aiohttp
from aiohttp import web

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "host", "content-length", "authorization"}
UPSTREAM = web.AppKey("upstream", str)
SESSION = web.AppKey("session", aiohttp.ClientSession)


async def session_ctx(app: web.Application):  # type: ignore[no-untyped-def]
    app[SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024))
    yield
    await app[SESSION].close()


async def forward(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
    url = request.app[UPSTREAM] + request.path
    async with request.app[SESSION].post(url, data=body, headers=headers) as upstream:
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            response = web.StreamResponse(status=upstream.status,
                                          headers={"content-type": "text/event-stream"})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
        payload = await upstream.read()
        return web.Response(body=payload, status=upstream.status,
                            content_type=upstream.content_type)


def main() -> None:
    import uvloop

    uvloop.install()
    port, upstream = int(sys.argv[1]), sys.argv[2]
    app = web.Application()
    app[UPSTREAM] = upstream
    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/chat/completions", forward)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


if __name__ == "__main__":
    main()
