"""Context rules roll out like any routing change: a rollout whose candidate policy has context rules of its own
sends its candidate arm's prompts as those rules make them (summaries of old turns here), while the live policy
(no context rules) leaves the stable arm's whole; the candidate arm's steps are measured in its cohort."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp

from gateway.server.resources import STATE
from tests.fixtures.conditions import until
from tests.fixtures.stack import ADMIN_TOKEN, Stack, metric
from tests.server.test_context_masking import client, tenants
from tests.server.test_old_turns import RULE, SUMMARY, conversation, is_summary_request, later

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


def rollout(objects: Path, weight: float) -> dict[str, Any]:
    steps: list[Any] = [{"set_weight": weight}, {"pause": {}}]
    return {"auth": {"enabled": True}, "store": {"objects": {"path": str(objects)}},
            "policies": {"managed": {"context": {"summarize_old_turns": RULE}}},
            "rollouts": [{"id": "context-rules", "route": "auto", "candidate": "policy:managed", "steps": steps,
                          "key": ["header:x-session-id"]}]}


async def _weight(stack: Stack) -> float:
    async with aiohttp.ClientSession(headers=ADMIN) as http, \
            http.get(stack.gateway.make_url("/admin/rollouts/auto")) as resp:
        return float((await resp.json()).get("weight_pct") or 0.0) if resp.status == 200 else 0.0


def received(stack: Stack) -> list[dict[str, Any]]:
    return [b for b in [*stack.fast.received, *stack.hq.received] if not is_summary_request(b)]


async def _step(stack: Stack, key: str, messages: list[Any], session: str) -> None:
    async with client(stack, key) as sdk:
        await sdk.chat.completions.create(model="auto", max_tokens=16, messages=messages,
                                          extra_headers={"x-session-id": session})


async def test_the_candidate_arm_reads_its_prompts_as_the_candidate_policys_context_rules_make_them(
    make_stack: Any, tmp_path: Path
) -> None:
    stack: Stack = await make_stack(rollout(tmp_path / "objects", 100))
    for fake in (stack.fast, stack.hq):
        fake.answer = lambda body: SUMMARY if is_summary_request(body) else "tok tok"
    acme, _ = await tenants(stack)
    async def at_full_weight() -> bool:
        return await _weight(stack) == 100.0

    await until(at_full_weight, what="the rollout at 100%")
    first = conversation("chat")
    await _step(stack, acme, first, "candidate-run")
    assert received(stack)[-1]["messages"] == first  # no summary ready yet: whole
    evictions = stack.gateway.app[STATE].evictions
    await until(lambda: evictions.ready_for("acme"), what="the candidate's summary written")
    await _step(stack, acme, later("chat", first, 1), "candidate-run")
    sent = received(stack)[-1]["messages"]
    assert "Context summary written by the gateway" in sent[1]["content"] and len(sent) < len(first)
    assert await metric(stack.gateway, "gateway_rollout_requests_total", route="auto", arm="candidate") == 2


async def test_the_stable_arm_keeps_the_live_policys_context(make_stack: Any, tmp_path: Path) -> None:
    stack: Stack = await make_stack(rollout(tmp_path / "objects", 100))
    acme, _ = await tenants(stack)
    # paused before any weight: every request is on stable, whose policy has no context rules
    async with aiohttp.ClientSession(headers=ADMIN) as http:
        async with http.get(stack.gateway.make_url("/admin/rollouts/auto")) as resp:
            generation = (await resp.json())["generation"]
        async with http.post(stack.gateway.make_url("/admin/rollouts/auto/abort"),
                             json={"actor": "test", "reason": "stable only", "generation": generation}) as resp:
            assert resp.status == 200, await resp.text()
    first = conversation("chat")
    await _step(stack, acme, first, "stable-run")
    await _step(stack, acme, later("chat", first, 1), "stable-run")
    assert received(stack)[-1]["messages"] == later("chat", first, 1)  # whole
    assert not stack.gateway.app[STATE].evictions.ready_for("acme")
    assert not any(is_summary_request(b) for b in stack.fast.received)


async def test_a_shadow_onto_a_policy_without_context_rules_reads_the_step_whole(
    make_stack: Any, tmp_path: Path
) -> None:
    """Managed against full context on the same step: the client's answer comes from the masked prompt, and a
    shadow onto the same deployment reads the prompt as the agent sent it."""
    from tests.server.test_context_masking import chat_messages, context_policy

    policy = context_policy(tmp_path / "objects") | {
        "policies": {"full": {"context": {}}},
        "shadows": [{"route": "fast", "target": "policy:full", "percent": 100, "sample_by": "random"}]}
    stack: Stack = await make_stack(policy)
    acme, _ = await tenants(stack)
    async with client(stack, acme) as sdk:
        await sdk.chat.completions.create(model="fast", max_tokens=16, messages=chat_messages())
    await until(lambda: len(stack.fast.received) == 2, what="the shadow's call")
    bodies = [b["messages"] for b in stack.fast.received]
    whole = [m for m in bodies if m == chat_messages()]
    masked = [m for m in bodies if any("masked by the gateway" in str(x.get("content")) for x in m)]
    assert len(whole) == 1 and len(masked) == 1
