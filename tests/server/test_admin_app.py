"""The admin API is one sub-app at /admin/ behind the one admin check: every route in it needs the token (403 while
none is set, 401 without the right one), an unknown admin path too (then a 404), and nothing outside it does."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from gateway.server.admin_app import create_admin_app
from gateway.server.settings import Settings
from tests.fixtures.stack import ADMIN_TOKEN, Stack

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


def _admin_routes() -> list[tuple[str, str]]:
    """Every route the sub-app declares (but the HEAD aiohttp adds to each GET), its placeholders filled in."""
    found = []
    for route in create_admin_app().router.routes():
        if route.method == "HEAD":
            continue
        path = re.sub(r"\{[^}]+\}", "x", route.resource.canonical if route.resource else "")
        found.append((route.method, "/admin" + path))
    return sorted(set(found))


ROUTES = _admin_routes()
UNKNOWN = [("GET", "/admin/nope"), ("POST", "/admin/nope"), ("GET", "/admin/"), ("GET", "/admin/sessions/")]


def test_the_sub_app_holds_the_admin_api() -> None:
    paths = {path for _, path in ROUTES}
    assert {"/admin/policy", "/admin/explain", "/admin/rollouts/x", "/admin/sessions/x", "/admin/deployments",
            "/admin/outcomes", "/admin/shadow/pairs", "/admin/usage"} <= paths
    assert all(path.startswith("/admin/") for path in paths)


async def _call(base: Any, method: str, path: str, headers: dict[str, str]) -> tuple[int, Any, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.request(method, base.make_url(path), headers=headers, data=b"{}") as resp:
            return resp.status, resp.headers, await resp.json()


@pytest.mark.parametrize(("method", "path"), ROUTES + UNKNOWN)
async def test_every_admin_path_needs_the_token(stack: Stack, method: str, path: str) -> None:
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": ADMIN_TOKEN}):
        status, answered, body = await _call(stack.gateway, method, path, headers)
        assert status == 401 and body["error"]["code"] == "invalid_admin_token", (headers, body)
        assert answered["x-request-id"]
    status, _, body = await _call(stack.gateway, method, path, ADMIN)
    assert status not in (401, 403), body  # past the check: the handler's own answer (or a 404 for no route)


async def test_with_the_admin_api_disabled_every_admin_path_is_403(
    stack: Stack, gateway_server: Callable[[Settings], Any]
) -> None:
    disabled = await gateway_server(Settings(policy=str(stack.policy_path), admin_token=""))
    for method, path in ROUTES + UNKNOWN:
        status, _, body = await _call(disabled, method, path, ADMIN)
        assert status == 403 and body["error"]["type"] == "permission_error", (path, body)


@pytest.mark.parametrize(("method", "path"), UNKNOWN)
async def test_an_unknown_admin_path_is_the_gateways_404(stack: Stack, method: str, path: str) -> None:
    status, _, body = await _call(stack.gateway, method, path, ADMIN)
    assert status == 404 and body["error"]["code"] == "unknown_path"


async def test_a_wrong_method_is_a_405_envelope(stack: Stack) -> None:
    status, _, body = await _call(stack.gateway, "GET", "/admin/explain", ADMIN)
    assert status == 405 and set(body["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("path", ["/admin", "/healthz", "/readyz", "/v1/models", "/ui", "/"])
async def test_the_paths_outside_it_need_no_admin_token(stack: Stack, path: str) -> None:
    async with aiohttp.ClientSession() as http, http.get(stack.gateway.make_url(path)) as resp:
        assert resp.status == (404 if path == "/admin" else 200)  # `/admin` is no admin path: unknown


async def test_its_handlers_read_the_gateways_resources(stack: Stack) -> None:
    """POST /admin/explain reads the body as the live path does (pipeline.read: the app's policy and settings)."""
    body = {"model": "auto", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession(headers=ADMIN) as http:
        async with http.post(stack.gateway.make_url("/admin/explain"), json=body) as resp:
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["deployment"] == "fast"
