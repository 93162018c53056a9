"""The public endpoints (server/public.py): the model list both SDKs read, liveness and readiness that need no
token, a readiness report that says where a reload failed but never what was written there, the Prometheus scrape."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
import yaml

from gateway.accounting import keys
from gateway.server.resources import STATE
from tests.fixtures.conditions import until
from tests.fixtures.stack import ADMIN_TOKEN, Stack

HELLO: list[Any] = [{"role": "user", "content": "hello there"}]
MODELS = {"auto": {"route": "rules", "description": "routed by the rules"},
          "hq": {"pin": "hq", "description": "the big model"}, "fast": {"pin": "fast"}}
SHARE_RULES = [{"name": "top-fifth-to-hq", "when": {"complexity": {"hq_share": 0.2, "window": 400}}, "use": "hq"}]
SECRET = "s3cret-value"


async def _get(stack: Stack, path: str, method: str = "GET", **headers: str) -> tuple[int, Any, str]:
    async with aiohttp.ClientSession() as http:
        async with http.request(method, stack.gateway.make_url(path), headers=headers) as resp:
            return resp.status, resp.headers, await resp.text()


async def _ready(stack: Stack) -> tuple[int, Any, str]:
    status, _, text = await _get(stack, "/readyz")
    return status, json.loads(text), text


async def test_the_model_list_is_the_policys_models_as_the_openai_sdk_reads_it(make_stack: Any) -> None:
    stack: Stack = await make_stack({"models": MODELS})
    async with stack.client() as client:
        listed = [model async for model in await client.models.list()]
    assert [m.id for m in listed] == ["auto", "hq", "fast"]  # the policy's order
    assert all((m.object, m.owned_by, m.created) == ("model", "agent-gateway", 0) for m in listed)


async def test_the_model_list_is_the_policys_models_as_the_anthropic_sdk_reads_it(make_stack: Any) -> None:
    stack: Stack = await make_stack({"models": MODELS})
    async with anthropic.AsyncAnthropic(base_url=stack.gateway_root, api_key="k", max_retries=0) as client:
        page = await client.models.list()
        every = [model.id async for model in client.models.list()]  # pages on while has_more: one page here
    assert (page.first_id, page.last_id, page.has_more) == ("auto", "fast", False)
    assert every == ["auto", "hq", "fast"]
    assert [(m.type, m.display_name, m.created_at.year) for m in page.data] == [("model", n, 1970) for n in every]


async def test_the_model_list_carries_each_description_and_follows_a_reload(make_stack: Any) -> None:
    stack: Stack = await make_stack({"models": MODELS})
    _, _, text = await _get(stack, "/v1/models")
    assert [m["description"] for m in json.loads(text)["data"]] == ["routed by the rules", "the big model", ""]
    policy = yaml.safe_load(stack.policy_path.read_text())
    policy["models"]["coder"] = {"pin": "hq", "description": "for code"}
    stack.policy_path.write_text(yaml.safe_dump(policy, sort_keys=False))

    async def listed() -> Any:
        _, _, text = await _get(stack, "/v1/models")
        body = json.loads(text)
        return body if body["last_id"] == "coder" else None
    body = await until(listed, what="the reloaded policy's model listed")
    assert [m["id"] for m in body["data"]] == ["auto", "hq", "fast", "coder"] and body["first_id"] == "auto"


@pytest.mark.parametrize(("method", "path"), [("HEAD", "/"), ("GET", "/"), ("GET", "/healthz"),
                                              ("GET", "/readyz"), ("GET", "/metrics")])
async def test_liveness_readiness_and_the_scrape_need_no_token_with_keys_and_an_admin_token_set(
    make_stack: Any, method: str, path: str
) -> None:
    """Claude Code checks the base URL with a HEAD / before anything else: no key of any kind may be asked."""
    stack: Stack = await make_stack({"auth": {"enabled": True}})
    await keys.create(stack.gateway.app[STATE].accounting.store, "acme")  # tenant keys exist, the admin token too
    status, _, text = await _get(stack, path, method)
    assert status == 200, text
    if path in ("/", "/healthz") and method == "GET":
        assert json.loads(text) == {"status": "ok"}


async def test_with_auth_on_the_model_list_is_a_v1_call_that_needs_a_tenant_key(make_stack: Any) -> None:
    stack: Stack = await make_stack({"auth": {"enabled": True}})
    _, raw = await keys.create(stack.gateway.app[STATE].accounting.store, "acme")
    status, _, _ = await _get(stack, "/v1/models", authorization=f"Bearer {ADMIN_TOKEN}")
    assert status == 401  # the admin token is no tenant key
    async with openai.AsyncOpenAI(base_url=stack.base_url, api_key=raw, max_retries=0) as client:
        assert [m.id async for m in await client.models.list()] == ["auto", "hq", "fast"]


async def test_not_ready_while_no_deployment_is_healthy_naming_each_then_ready_once_one_is(stack: Stack) -> None:
    stack.fast.healthy = stack.hq.healthy = False

    async def unready() -> Any:
        status, body, _ = await _ready(stack)
        return body if status == 503 else None
    body = await until(unready, what="both deployments seen unhealthy")
    assert body["ready"] is False and body["healthy_deployments"] == []
    assert body["problems"] == ["no deployment is healthy: hq failing health checks or ejected, "
                                "fast failing health checks or ejected"]
    stack.fast.healthy = True

    async def ready() -> Any:
        status, body, _ = await _ready(stack)
        return body if status == 200 else None
    body = await until(ready, what="fast seen healthy again")
    assert body["ready"] is True and body["healthy_deployments"] == ["fast"] and body["problems"] == []
    assert body["policy"]["path"] == str(stack.policy_path) and body["policy"]["last_reload_error"] is None


def _bad_default(policy: dict[str, Any]) -> None:
    policy["default"] = f"nowhere-{SECRET}"  # the message quotes it: "unknown deployment 'nowhere-...'"


def _bad_timeout(policy: dict[str, Any]) -> None:
    policy["deployments"]["hq"]["timeouts"]["read_s"] = SECRET  # the problem ends "(value: '...')"


def _line_of(text: str, key: str) -> int:
    """The 1-based line of the first line whose key is `key` (the line a problem names)."""
    return next(i for i, line in enumerate(text.splitlines(), 1) if line.strip().startswith(key + ":"))


@pytest.mark.parametrize(("edit", "key", "field"), [(_bad_default, "default", "default"),
                                                   (_bad_timeout, "read_s", "deployments.hq.timeouts.read_s")])
async def test_a_failed_reload_shows_file_line_and_field_never_the_message_or_the_value(
    stack: Stack, edit: Callable[[dict[str, Any]], None], key: str, field: str
) -> None:
    """/readyz is public: it says where the bad edit is, the admin API (GET /admin/policy) says what it is."""
    policy = yaml.safe_load(stack.policy_path.read_text())
    edit(policy)
    text = yaml.safe_dump(policy, sort_keys=False)
    stack.policy_path.write_text(text)
    status, body, public = await until(_reload_failed(stack), what="the bad edit seen by the poller")
    where = f"{stack.policy_path}:{_line_of(text, key)}: {field}"
    assert SECRET not in public and "unknown deployment" not in public and "Input should be" not in public
    assert body["problems"] == [f"the last policy reload failed (serving the previous policy): {where} "
                                "(the details: GET /admin/policy)"]
    assert body["policy"]["last_reload_error"] == [where]
    assert status == 200  # the previous policy serves, its deployments healthy: ready all the same


async def test_a_reload_that_is_no_yaml_shows_only_file_and_line(stack: Stack) -> None:
    stack.policy_path.write_text(stack.policy_path.read_text() + f"extra: [{SECRET}\n")
    _, body, public = await until(_reload_failed(stack), what="the broken file seen by the poller")
    (where,) = body["policy"]["last_reload_error"]
    assert re.fullmatch(re.escape(str(stack.policy_path)) + r":\d+", where), where
    assert SECRET not in public and "YAML" not in public


def _reload_failed(stack: Stack) -> Callable[[], Any]:
    async def failed() -> Any:
        status, body, text = await _ready(stack)
        return (status, body, text) if body["policy"]["last_reload_error"] else None
    return failed


async def test_the_scrape_is_prometheus_text_naming_the_worker_that_answered(make_stack: Any) -> None:
    stack: Stack = await make_stack(settings={"worker_index": 3})
    status, headers, text = await _get(stack, "/metrics")
    assert status == 200 and headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert headers["x-gateway-worker"] == "3"
    assert "# TYPE gateway_requests_total counter" in text


async def test_each_scrape_exports_the_complexity_shares_as_they_are_then(make_stack: Any) -> None:
    stack: Stack = await make_stack(rules=SHARE_RULES)
    series = ('gateway_complexity_share_target{route="auto",share="0.2"} 0.2',
              'gateway_complexity_threshold{route="auto",share="0.2"} ',
              'gateway_complexity_share_observed{route="auto",share="0.2"} ')
    _, _, before = await _get(stack, "/metrics")
    assert not any(s in before for s in series)  # the route is tracked from its first call on
    async with stack.client() as client:
        await client.chat.completions.create(model="auto", messages=HELLO)
    _, _, after = await _get(stack, "/metrics")  # at once: the scrape itself exports them
    assert all(s in after for s in series), after
