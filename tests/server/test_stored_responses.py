"""The Responses API's stored answers are kept within the policy's `store.responses` limits, read at each answer
kept, so a reload applies to the answers kept after it."""

from __future__ import annotations

from typing import Any

import openai
import yaml

from gateway.server.resources import STATE
from tests.fixtures.conditions import until
from tests.fixtures.stack import Stack


async def _kept(stack: Stack, response_ids: list[str]) -> list[bool]:
    found = []
    async with stack.client() as client:
        for response_id in response_ids:
            try:
                await client.responses.retrieve(response_id)
                found.append(True)
            except openai.NotFoundError:
                found.append(False)
    return found


async def _answers(stack: Stack, count: int) -> list[str]:
    async with stack.client() as client:
        return [(await client.responses.create(model="fast", input=f"step {n}", max_output_tokens=8)).id
                for n in range(count)]


async def test_a_tenant_over_the_policys_count_loses_its_oldest_answers_first(make_stack: Any) -> None:
    stack: Stack = await make_stack("store: {responses: {max_per_tenant: 2}}")
    ids = await _answers(stack, 3)
    assert await _kept(stack, ids) == [False, True, True]


async def test_a_reloaded_limit_applies_to_the_answers_kept_after_it(make_stack: Any) -> None:
    stack: Stack = await make_stack()
    first = await _answers(stack, 2)
    assert await _kept(stack, first) == [True, True]  # the default keeps 10,000 a tenant
    policy = yaml.safe_load(stack.policy_path.read_text())
    stack.policy_path.write_text(yaml.safe_dump({**policy, "store": {"responses": {"max_per_tenant": 1}}}))
    current = stack.gateway.app[STATE].policy_file
    await until(lambda: current.current.store.responses.max_per_tenant == 1, what="the policy reloaded")
    later = await _answers(stack, 1)
    assert await _kept(stack, [*first, *later]) == [False, False, True]
