"""Hot reload: an edit swaps the policy for new requests; a bad edit keeps the old one and says why."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp

from tests.fixtures.processes import free_port, spawn_gateway
from tests.fixtures.stack import ADMIN_TOKEN, Stack

HELLO = [{"role": "user", "content": "hi"}]


async def _deployment(stack: Stack) -> str:
    async with stack.client() as client:
        raw = await client.chat.completions.with_raw_response.create(model="auto", messages=HELLO)
    return raw.headers["x-gateway-deployment"]


async def _wait_for(predicate: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def _get(stack: Stack, path: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.get(stack.gateway.make_url(path),
                            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as resp:
            return resp.status, (await resp.json() if "json" in resp.content_type else await resp.text())


async def test_edit_swaps_policy_and_bad_edit_keeps_the_old(stack: Stack) -> None:
    original = stack.policy_path.read_text()
    assert await _deployment(stack) == "fast"

    stack.policy_path.write_text(original.replace("default: fast", "default: hq"))

    async def on_hq() -> bool:
        return await _deployment(stack) == "hq"
    await _wait_for(on_hq)

    stack.policy_path.write_text(original.replace("default: fast", "default: nowhere-s3cret"))

    async def reload_failed() -> bool:
        _, body = await _get(stack, "/readyz")
        return bool(body["problems"])
    await _wait_for(reload_failed)  # what /readyz shows of it (where, never what): tests/server/test_public.py
    _, detail = await _get(stack, "/admin/policy")
    assert "default: unknown deployment 'nowhere-s3cret'" in detail["last_reload_error"][0]
    assert await _deployment(stack) == "hq"  # the previous good policy still serves
    _, metrics = await _get(stack, "/metrics")
    assert "gateway_policy_last_reload_ok 0.0" in metrics
    assert 'gateway_policy_reloads_total{result="invalid"}' in metrics

    stack.policy_path.write_text(original)

    async def on_fast() -> bool:
        return await _deployment(stack) == "fast"
    await _wait_for(on_fast)
    status, body = await _get(stack, "/readyz")
    assert body["problems"] == [] and status == 200


async def test_sighup_reloads_a_running_server(make_stack: Any, tmp_path: Path) -> None:
    stack: Stack = await make_stack()  # only for its fake deployments and policy file
    port = free_port()
    env = {**os.environ, "AGENT_GATEWAY_POLICY_POLL_S": "3600", "AGENT_GATEWAY_LOG_LEVEL": "WARNING"}
    proc = spawn_gateway(stack.policy_path, port, env)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    try:
        async with aiohttp.ClientSession() as http:
            async def served_by() -> str | None:
                try:
                    async with http.post(url, json={"model": "auto", "messages": HELLO}) as resp:
                        return resp.headers.get("x-gateway-deployment")
                except aiohttp.ClientConnectionError:
                    return None

            async def up() -> bool:
                return await served_by() is not None
            await _wait_for(up, 60)
            assert await served_by() == "fast"
            stack.policy_path.write_text(stack.policy_path.read_text().replace("default: fast", "default: hq"))
            await asyncio.sleep(0.3)  # a negative check: a poller (the tests poll every 0.1 s) would have reloaded
            assert await served_by() == "fast"  # polling is off: only SIGHUP reloads
            proc.send_signal(signal.SIGHUP)

            async def on_hq() -> bool:
                return await served_by() == "hq"
            await _wait_for(on_hq)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert proc.returncode == 0, proc.stderr.read().decode() if proc.stderr else ""
