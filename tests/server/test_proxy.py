"""The request path through real aiohttp servers with the openai SDK as the client."""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from fakes.faulty_vllm import FakeVLLM, Fault
from gateway.server.settings import Settings
from tests.fixtures.conditions import until
from tests.fixtures.stack import ADMIN_TOKEN, Stack, fake_server, policy_yaml, with_deployment

HELLO = [{"role": "user", "content": "hello there"}]
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER_PARAMETERS}}]


async def test_chat_auto_goes_to_default_fast_and_headers_name_the_decision(stack: Stack) -> None:
    async with stack.client() as client:
        raw = await client.chat.completions.with_raw_response.create(model="auto", messages=HELLO)
    completion = raw.parse()
    assert completion.model == "fake-fast"
    assert raw.headers["x-gateway-deployment"] == "fast"
    assert raw.headers["x-gateway-rule"] == "default"
    assert len(raw.headers["x-request-id"]) >= 16
    assert completion.usage is not None and completion.usage.completion_tokens == 8


async def test_every_response_names_its_request_and_proxied_ones_the_decision(stack: Stack) -> None:
    body = {"model": "hq", "messages": HELLO, "stream": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(stack.base_url + "/chat/completions", json=body) as stream:
            assert stream.status == 200 and "[DONE]" in await stream.text()
            assert (stream.headers["x-gateway-deployment"], stream.headers["x-gateway-rule"]) == ("hq", "pin:hq")
            assert stream.headers["x-request-id"]
        for path in ("/models", "/no-such-path"):
            async with http.get(stack.base_url + path) as resp:
                assert resp.headers["x-request-id"] and "x-gateway-deployment" not in resp.headers
        async with http.post(stack.base_url + "/chat/completions", json={"model": "nope", "messages": HELLO}) as resp:
            assert resp.status == 404 and resp.headers["x-gateway-deployment"] == "none"


async def test_pinned_models_reach_their_deployment(stack: Stack) -> None:
    async with stack.client() as client:
        hq = await client.chat.completions.create(model="hq", messages=HELLO)
        fast = await client.chat.completions.create(model="fast", messages=HELLO, tools=TOOLS)
    assert hq.model == "fake-hq"
    # A pin wins over the tools rule: rules only apply to `auto` unless they override pins.
    assert fast.model == "fake-fast"


async def test_tool_calls_pass_through_and_route_by_rule(stack: Stack) -> None:
    async with stack.client() as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="auto", messages=HELLO, tools=TOOLS, tool_choice="auto")
    completion = raw.parse()
    assert raw.headers["x-gateway-rule"] == "tools-to-hq"
    call = completion.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


async def test_body_reaches_deployment_unchanged_except_model(stack: Stack) -> None:
    extra: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": False}, "top_k": 5,
                             "unknown_future_field": [1, {"x": None}]}
    async with stack.client() as client:
        await client.chat.completions.create(
            model="auto", messages=HELLO, tools=TOOLS, tool_choice="none", seed=7, n=1, logprobs=True,
            response_format={"type": "json_object"}, extra_body=extra, extra_headers={"x-custom": "kept"})
    sent = stack.hq.received[-1]
    assert sent["model"] == "fake-hq"
    for key, value in {**extra, "seed": 7, "n": 1, "logprobs": True, "tool_choice": "none", "tools": TOOLS,
                       "response_format": {"type": "json_object"}, "messages": HELLO}.items():
        assert sent[key] == value, key
    headers = {k.lower(): v for k, v in stack.hq.headers_seen[-1].items()}
    assert "authorization" not in headers and "sk-client-secret" not in json.dumps(headers)
    assert headers["x-custom"] == "kept"


async def test_an_idle_kept_alive_connection_keeps_no_request_body(stack: Stack) -> None:
    """aiohttp's connection handler holds its last request until the client sends the next one on the
    connection: an agent's 100-200 KB body must not stay on it (200 idle agents would hold 30 MB)."""
    big = [{"role": "user", "content": "x" * 200_000}]
    async with aiohttp.ClientSession() as http:  # keeps its connection open, idle, after the response
        async with http.post(stack.base_url + "/chat/completions", json={"model": "auto", "messages": big}) as resp:
            assert resp.status == 200
            await resp.read()
        held = [r for r in gc.get_objects() if isinstance(r, web.BaseRequest) and r.app is stack.gateway.app]
        assert held  # what this is about: the idle connection's handler still holds its request
        assert max(map(len, _bytes_reachable(held)), default=0) < 100_000


def _bytes_reachable(roots: list[Any], depth: int = 3) -> list[bytes | bytearray | memoryview]:
    """The byte strings within `depth` references of roots (not through an application or a transport)."""
    seen, found, level = {id(r) for r in roots}, [], list(roots)
    for _ in range(depth):
        nxt = []
        for obj in level:
            for ref in gc.get_referents(obj):
                if id(ref) in seen or isinstance(ref, (web.Application, asyncio.BaseTransport, type)):
                    continue
                seen.add(id(ref))
                if isinstance(ref, (bytes, bytearray, memoryview)):
                    found.append(ref)
                else:
                    nxt.append(ref)
        level = nxt
    return found


async def test_json_edge_values_reach_deployment_as_json_writes_them(stack: Stack) -> None:
    """The fast codec refuses a lone surrogate escape; json's leniency and encoding still hold for it,
    and for NaN, big integers and repeated keys (the last one wins)."""
    raw = ('{"model": "auto", "messages": [{"role": "user", "content": "half \\ud83d"}], "temperature": 0.5,'
           ' "seed": 123456789012345678901234567890, "x": NaN, "top_k": 1, "top_k": 2}')
    async with aiohttp.ClientSession() as http:
        async with http.post(stack.base_url + "/chat/completions", data=raw.encode(),
                             headers={"content-type": "application/json"}) as resp:
            assert resp.status == 200, await resp.text()
    sent = stack.fast.received[-1]
    assert sent["messages"][0]["content"] == "half \ud83d"
    assert sent["seed"] == 123456789012345678901234567890 and sent["top_k"] == 2
    assert sent["x"] != sent["x"]  # NaN
    assert sent["temperature"] == 0.5 and sent["model"] == "fake-fast"


async def test_streaming_relays_chunks_and_hides_usage_the_client_did_not_ask_for(stack: Stack) -> None:
    async with stack.client() as client:
        stream = await client.chat.completions.create(model="fast", messages=HELLO, stream=True)
        chunks = [chunk async for chunk in stream]
    assert stack.fast.received[-1]["stream_options"] == {"include_usage": True}
    assert all(chunk.usage is None for chunk in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).count("tok") == 8
    assert await _metric(stack, 'gateway_tokens_total{deployment="fast",direction="output"}') == 8.0


async def test_streaming_keeps_usage_when_asked(stack: Stack) -> None:
    async with stack.client() as client:
        stream = await client.chat.completions.create(
            model="fast", messages=HELLO, stream=True, stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 11


async def test_completions_and_embeddings(stack: Stack) -> None:
    async with stack.client() as client:
        completion = await client.completions.create(model="hq", prompt="Say hi")
        embedding = await client.embeddings.create(model="fast", input="hi")
    assert completion.model == "fake-hq"
    assert embedding.model == "fake-fast" and embedding.data[0].embedding == [0.1, 0.2]


async def test_embeddings_to_a_deployment_without_them_is_a_clear_404(stack: Stack) -> None:
    async with stack.client() as client:
        with pytest.raises(openai.NotFoundError) as caught:
            await client.embeddings.create(model="hq", input="hi")
    assert "embeddings" in caught.value.message


async def test_failover_before_first_byte_on_5xx(stack: Stack) -> None:
    stack.fast.faults.append(Fault(status=503))
    async with stack.client() as client:
        raw = await client.chat.completions.with_raw_response.create(model="auto", messages=HELLO)
    assert raw.parse().model == "fake-hq"
    assert raw.headers["x-gateway-deployment"] == "hq"
    assert await _metric(stack, 'gateway_failovers_total{from_deployment="fast",reason="upstream_5xx"}') == 1.0


# An aborted-looking rollout (its candidate at weight 0) and a judge for labels: both deployments exist only
# for experiments, and up to four attempts would reach them if failover went on to "the rest".
EXPERIMENTS_ONLY = """
    max_attempts: 4
    labels: {strong: hq, weak: fast, judge: {deployment: judge}}
    rollouts:
      - id: hq-v2-held
        route: hq
        candidate: deployment:hq-v2
        stable: deployment:hq
        steps: [{pause: {}}]
"""


async def test_failover_never_sends_clients_to_a_deployment_only_experiments_use(
    fake_pair: Any, gateway_server: Callable[[Settings], Any], aiohttp_server: Callable[..., Any], tmp_path: Path
) -> None:
    hq, hq_server, fast, fast_server = fake_pair
    judge, candidate = FakeVLLM("fake-judge"), FakeVLLM("fake-hq-v2")
    text = policy_yaml(str(hq_server.make_url("")).rstrip("/"), str(fast_server.make_url("")).rstrip("/"),
                       EXPERIMENTS_ONLY)
    text = with_deployment(text, "judge", await fake_server(judge, aiohttp_server), "fake-judge")
    text = with_deployment(text, "hq-v2", await fake_server(candidate, aiohttp_server), "fake-hq-v2")
    (tmp_path / "policy.yaml").write_text(text)
    stack = Stack(hq, fast, await gateway_server(Settings(policy=str(tmp_path / "policy.yaml"))), tmp_path)
    fast.faults.append(Fault(status=503))
    hq.faults.append(Fault(status=503))
    async with stack.client() as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="auto", messages=HELLO)
    assert caught.value.status_code == 502
    assert judge.received == [] and candidate.received == []


async def test_failover_on_timeout(make_stack: Any) -> None:
    stack: Stack = await make_stack(read_s="0.3")
    stack.fast.faults.append(Fault(stall_s=1.0))
    async with stack.client() as client:
        completion = await client.chat.completions.create(model="auto", messages=HELLO)
    assert completion.model == "fake-hq"


async def test_timeout_everywhere_is_504(make_stack: Any) -> None:
    stack: Stack = await make_stack(read_s="0.2")
    stack.fast.faults.append(Fault(stall_s=1.0))
    stack.hq.faults.append(Fault(stall_s=1.0))
    async with stack.client() as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="auto", messages=HELLO)
    assert caught.value.status_code == 504
    assert caught.value.body["type"] == "timeout_error"  # type: ignore[index]


async def test_failure_after_first_byte_ends_with_one_sse_error_event(make_stack: Any) -> None:
    stack: Stack = await make_stack("resume: {enabled: false}\n")  # resumed on hq otherwise (test_resuming.py)
    stack.fast.faults.append(Fault(drop_after_chunks=3))
    async with stack.client() as client:
        stream = await client.chat.completions.create(model="fast", messages=HELLO, stream=True)
        received = []
        with pytest.raises(openai.APIError) as caught:
            async for chunk in stream:
                received.append(chunk)
    assert len(received) == 3
    assert "mid-response" in caught.value.message or "before [DONE]" in caught.value.message
    assert len(stack.hq.received) == 0  # no failover once bytes reached the client


async def test_truncated_stream_is_never_a_silent_200(make_stack: Any) -> None:
    stack: Stack = await make_stack("resume: {enabled: false}\n")
    stack.fast.faults.append(Fault(truncate_after_chunks=2))
    async with aiohttp.ClientSession() as http:
        async with http.post(stack.base_url + "/chat/completions",
                             json={"model": "fast", "messages": HELLO, "stream": True}) as resp:
            text = await resp.text()
    events = [e for e in text.split("\n\n") if e.strip()]
    assert len(events) == 3
    assert json.loads(events[-1].removeprefix("data: "))["error"]["code"] == "upstream_truncated"


async def test_client_disconnect_cancels_upstream(make_stack: Any) -> None:
    stack: Stack = await make_stack()
    stack.fast.chunks = 10_000
    async with aiohttp.ClientSession() as http:
        resp = await http.post(stack.base_url + "/chat/completions",
                               json={"model": "fast", "messages": HELLO, "stream": True})
        await resp.content.readline()
        resp.close()
    await until(lambda: stack.fast.cancelled == 1, what="fast saw its stream dropped")


async def test_a_client_gone_before_the_headers_cancels_the_upstream_request(make_stack: Any) -> None:
    """The server runs as in production (handler_cancellation): a client that hangs up while the deployment
    is still thinking cancels the handler, which drops the upstream request instead of waiting it out."""
    stack: Stack = await make_stack(read_s="60", total_s="60")
    stack.fast.faults.append(Fault(hold=True))
    async with aiohttp.ClientSession() as http:
        request = asyncio.ensure_future(http.post(stack.base_url + "/chat/completions",
                                                  json={"model": "fast", "messages": HELLO}))
        await until(lambda: len(stack.fast.received) == 1, what="the request reached fast")
        request.cancel()  # the client hangs up
        await asyncio.gather(request, return_exceptions=True)
    await until(lambda: stack.fast.cancelled == 1, what="fast saw the upstream request dropped")


async def test_dead_deployment_is_ejected_and_traffic_fails_over(make_stack: Any, fake_pair: Any) -> None:
    stack: Stack = await make_stack()
    _, _, _, fast_server = fake_pair
    await fast_server.close()
    async with stack.client() as client:
        for _ in range(3):
            completion = await client.chat.completions.create(model="auto", messages=HELLO)
            assert completion.model == "fake-hq"
    async with aiohttp.ClientSession() as http:
        async with http.get(stack.gateway.make_url("/readyz")) as resp:
            ready = await resp.json()
    assert ready["healthy_deployments"] == ["hq"]


async def test_no_healthy_deployment_is_503(stack: Stack) -> None:
    stack.fast.healthy = stack.hq.healthy = False
    await until(lambda: _ready_status(stack, 503), what="both deployments seen unhealthy")
    async with stack.client() as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="auto", messages=HELLO)
    assert caught.value.status_code == 503


async def test_deep_queue_on_fast_spills_to_hq(stack: Stack) -> None:
    stack.fast.waiting = 20
    waiting = 'gateway_deployment_requests_waiting{deployment="fast"}'
    await until(lambda: _metric_is(stack, waiting, 20), what="the gateway scraped the deep queue")
    async with stack.client() as client:
        raw = await client.chat.completions.with_raw_response.create(model="auto", messages=HELLO)
    assert raw.headers["x-gateway-deployment"] == "hq"
    async with aiohttp.ClientSession() as http:
        explained = await _admin_get(http, stack, f"/admin/requests/{raw.headers['x-request-id']}/explain")
    assert any("spill: fast has 20 waiting" in r for r in explained["reasons"])
    assert explained["load"]["fast"]["requests_waiting"] == 20


async def test_explain_live_request_shows_rule_trail(stack: Stack) -> None:
    async with stack.client() as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="auto", messages=HELLO, extra_headers={"x-priority": "high"})
    request_id = raw.headers["x-request-id"]
    async with aiohttp.ClientSession() as http:
        explained = await _admin_get(http, stack, f"/admin/requests/{request_id}/explain")
        async with http.get(stack.gateway.make_url(f"/admin/requests/{request_id}/explain")) as denied:
            assert denied.status == 401
    assert explained["deployment"] == "hq" and explained["rule"] == "priority-header"
    assert explained["reasons"][0].startswith("rule tools-to-hq: no match (tools=False")
    assert explained["reasons"][1].startswith("rule long-to-hq: no match (prompt_tokens=")


async def test_a_client_chosen_request_id_is_echoed_but_never_keys_the_explain_memory(stack: Stack) -> None:
    """Two clients sending the same x-request-id each keep their own trail: the gateway's id is the key."""
    async with stack.client() as client:
        first = await client.chat.completions.with_raw_response.create(
            model="auto", messages=HELLO, extra_headers={"x-request-id": "same", "x-priority": "high"})
        second = await client.chat.completions.with_raw_response.create(
            model="auto", messages=HELLO, extra_headers={"x-request-id": "same"})
    ids = first.headers["x-request-id"], second.headers["x-request-id"]
    assert len(set(ids)) == 2 and "same" not in ids
    assert first.headers["x-client-request-id"] == second.headers["x-client-request-id"] == "same"
    sent = {k.lower(): v for k, v in stack.hq.headers_seen[-1].items()}
    assert sent["x-request-id"] == ids[0]  # the deployment sees the gateway's id too
    async with aiohttp.ClientSession() as http:
        trails = [await _admin_get(http, stack, f"/admin/requests/{i}/explain") for i in ids]
        async with http.get(stack.gateway.make_url("/admin/requests/same/explain"),
                            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as resp:
            assert resp.status == 404
    assert [t["deployment"] for t in trails] == ["hq", "fast"]


async def _admin_get(http: aiohttp.ClientSession, stack: Stack, path: str) -> Any:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with http.get(stack.gateway.make_url(path), headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def _ready_status(stack: Stack, status: int) -> bool:
    async with aiohttp.ClientSession() as http, http.get(stack.gateway.make_url("/readyz")) as resp:
        return resp.status == status


async def _metric_is(stack: Stack, series: str, value: float) -> bool:
    try:
        return await _metric(stack, series) == value
    except AssertionError:  # not exported yet
        return False


async def _metric(stack: Stack, series: str) -> float:
    async with aiohttp.ClientSession() as http:
        async with http.get(stack.gateway.make_url("/metrics")) as resp:
            text = await resp.text()
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{series} not in /metrics")


async def test_the_explain_memory_keeps_one_copy_of_snapshots_consecutive_requests_share(stack: Stack) -> None:
    """Equal load, header and window snapshots are kept once, yet each request's trail stays its own."""
    from gateway.server.resources import STATE

    async with stack.client() as client:
        raws = [await client.chat.completions.with_raw_response.create(
            model="auto", messages=HELLO, extra_headers={"x-priority": p}) for p in ("low", "low", "high")]
    recent = stack.gateway.app[STATE].recent
    kept = [recent.get(raw.headers["x-request-id"]) for raw in raws]
    assert all(k is not None for k in kept)
    first, second, third = (k.ctx for k in kept if k is not None)
    for before, after in ((first, second), (second, third)):  # the load is scraped meanwhile: equal or not
        for name in ("headers", "load", "in_flight", "share_thresholds", "fits"):
            assert (getattr(after, name) == getattr(before, name)) == (getattr(after, name) is getattr(before, name))
    assert second.headers is first.headers and second.in_flight is first.in_flight
    assert third.headers == {"x-priority": "high"} and third.headers is not first.headers
    async with aiohttp.ClientSession() as http:
        trails = [await _admin_get(http, stack, f"/admin/requests/{raw.headers['x-request-id']}/explain")
                  for raw in raws]
    assert [t["deployment"] for t in trails] == ["fast", "fast", "hq"]
