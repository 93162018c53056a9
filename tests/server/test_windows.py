"""Windows that are true, through the gateway: each deployment's window learned from its /v1/models and listed on
the gateway's; a step that fits by cl100k but not by the deployment's tokenizer goes where it fits (never to
vLLM's 400), its output cap clamped to the room, or a 400 in the API's envelope when no deployment has room."""

from __future__ import annotations

from typing import Any

import aiohttp
import anthropic
import pytest
import yaml

from fakes.faulty_vllm import FakeVLLM
from gateway.server.resources import STATE
from tests.fixtures.conditions import until
from tests.fixtures.stack import Stack, metric

NO_RULES: dict[str, Any] = {"rules": []}  # every call goes to the default, fast


async def _models(stack: Stack) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http, http.get(stack.gateway.make_url("/v1/models")) as resp:
        return {m["id"]: m for m in (await resp.json())["data"]}


async def _learned(stack: Stack, **expected: int) -> None:
    await until(lambda: stack.gateway.app[STATE].deployments.windows == expected, what=f"windows learned: {expected}")


def _pair(fake_pair: Any, hq_window: int, fast_window: int) -> tuple[FakeVLLM, FakeVLLM]:
    hq, _, fast, _ = fake_pair
    hq.max_model_len, fast.max_model_len = hq_window, fast_window
    return hq, fast


async def test_each_window_is_learned_from_the_deployment_and_listed_per_model(fake_pair: Any, make_stack: Any) -> None:
    _pair(fake_pair, 32768, 4096)
    stack: Stack = await make_stack(rules=[])
    await _learned(stack, hq=32768, fast=4096)
    models = await _models(stack)
    # a routed model is served up to its widest deployment's window: a step too long for fast goes to hq
    assert {name: (m["context_window"], m["max_model_len"]) for name, m in models.items()} == {
        "auto": (32768, 32768), "hq": (32768, 32768), "fast": (4096, 4096)}
    assert await metric(stack.gateway, "gateway_deployment_context_window_tokens", deployment="fast") == 4096


async def test_the_policys_max_model_len_narrows_a_learned_window(fake_pair: Any, make_stack: Any) -> None:
    _pair(fake_pair, 32768, 32768)
    stack: Stack = await make_stack(rules=[])
    await _learned(stack, hq=32768, fast=32768)
    policy = yaml.safe_load(stack.policy_path.read_text())
    policy["deployments"]["fast"]["max_model_len"] = 2048  # room kept back on fast
    stack.policy_path.write_text(yaml.safe_dump(policy, sort_keys=False))

    async def narrowed() -> dict[str, Any] | None:
        models = await _models(stack)
        return models if models["fast"]["context_window"] == 2048 else None
    models = await until(narrowed, what="fast's window narrowed by the reloaded policy")
    assert models["auto"]["context_window"] == models["hq"]["context_window"] == 32768


async def test_a_step_that_fits_fast_by_cl100k_but_not_by_its_tokenizer_goes_to_hq(
    fake_pair: Any, make_stack: Any
) -> None:
    hq, fast = _pair(fake_pair, 32768, 4096)  # the fakes' tokenizer: 2.5 tokens per cl100k token of this text
    stack: Stack = await make_stack(rules=[])
    await _learned(stack, hq=32768, fast=4096)
    messages = [{"role": "user", "content": "word " * 2700}]  # 2,700 cl100k tokens: "fits" fast's 4,096
    assert fast._overflow({"messages": messages}) == 6750  # what fast itself would answer with a 400
    async with stack.client() as client:
        raw = await client.chat.completions.with_raw_response.create(model="auto", messages=messages)  # type: ignore[arg-type]
    assert raw.http_response.status_code == 200 and raw.headers["x-gateway-deployment"] == "hq"
    assert fast.received == [] and len(hq.received) == 1
    assert len(fast.tokenized) == 1  # counted by fast's own tokenizer, once
    explained = await _explain(stack, raw.headers["x-request-id"])
    assert any("skip fast: context window too small: fast's window of 4,096 tokens holds a prompt of 6,7" in r
               for r in explained["reasons"]), explained["reasons"]


async def test_claude_codes_max_tokens_is_clamped_to_the_room_the_window_leaves(
    fake_pair: Any, make_stack: Any
) -> None:
    """vLLM refuses a max_tokens above its window outright (`max_tokens=32000 cannot be greater than
    max_model_len=8192`); the gateway sends what fits, and says so."""
    hq, fast = _pair(fake_pair, 8192, 8192)
    stack: Stack = await make_stack(rules=[])
    await _learned(stack, hq=8192, fast=8192)
    text = "word " * 2000  # 5,000 of the fakes' tokens
    async with anthropic.AsyncAnthropic(base_url=stack.gateway_root, api_key="k", max_retries=0) as client:
        async with client.messages.stream(model="auto", max_tokens=32000,  # Claude Code's ask, streamed as it does
                                          messages=[{"role": "user", "content": text}]) as stream:
            answer = await stream.get_final_message()
    assert answer.type == "message"
    sent = fast.received[-1]["max_tokens"]
    counted = fast.count("\n".join(fast.tokenized))
    assert 8192 - counted - 64 <= sent <= 8192 - counted  # the room, less the template's wrapping
    assert hq.received == []


async def test_a_step_no_window_holds_is_a_400_in_the_apis_envelope(fake_pair: Any, make_stack: Any) -> None:
    hq, fast = _pair(fake_pair, 4096, 4096)
    stack: Stack = await make_stack(rules=[])
    await _learned(stack, hq=4096, fast=4096)
    async with anthropic.AsyncAnthropic(base_url=stack.gateway_root, api_key="k", max_retries=0) as client:
        with pytest.raises(anthropic.BadRequestError) as refused:
            await client.messages.create(model="auto", max_tokens=1024,
                                         messages=[{"role": "user", "content": "word " * 2700}])
    body = refused.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "hq's window of 4,096 tokens holds a prompt of" in body["error"]["message"]
    assert hq.received == [] and fast.received == []  # no deployment's own 400


async def _explain(stack: Stack, request_id: str) -> Any:
    from tests.fixtures.stack import ADMIN_TOKEN

    async with aiohttp.ClientSession() as http, http.get(
            stack.gateway.make_url(f"/admin/requests/{request_id}/explain"),
            headers={"authorization": f"Bearer {ADMIN_TOKEN}"}) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()
