"""The listening side: aiohttp's server, set up the one way that `serve` and the tests both run it."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

from aiohttp import web

from gateway.settings import Settings

# aiohttp's idle keep-alive default under web.run_app, which the gateway ran under before this module.
KEEPALIVE_S = 75.0
SHUTDOWN_S = 60.0  # requests in flight at SIGTERM get this long to finish


def runner_options(settings: Settings) -> dict[str, Any]:
    """The server's options, in one place: a client that goes away cancels its handler (and so the
    upstream request), no access log (the gateway's metrics and spans record every request)."""
    return {
        "handler_cancellation": True,
        "access_log": None,
        "keepalive_timeout": KEEPALIVE_S,
        "shutdown_timeout": SHUTDOWN_S,
    }


class GatewayRunner(web.AppRunner):
    """aiohttp's AppRunner with the gateway's server options."""

    def __init__(self, app: web.Application, settings: Settings) -> None:
        super().__init__(app, **runner_options(settings))


async def serve(app: web.Application, settings: Settings) -> None:
    """Listen on settings.host:port until SIGTERM or SIGINT, then shut down gracefully."""
    runner = GatewayRunner(app, settings)
    await runner.setup()
    try:
        site = web.TCPSite(runner, settings.host, settings.port, reuse_port=settings.workers > 1 or None)
        await site.start()
        await _stop_signal()
    finally:
        await runner.cleanup()


async def _stop_signal() -> None:
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopped.set)
    try:
        await stopped.wait()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
