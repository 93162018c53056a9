"""GET /admin/sessions[/{id}] and the outcome API on a running gateway name a session by the id its client sent
(issue 32, item 2): real aiohttp servers, fake deployments, agents driven by the openai SDK."""

from __future__ import annotations

from typing import Any

import aiohttp

from gateway.server.resources import STATE
from tests.fixtures.agent_runs import Agent, admin, recorded
from tests.fixtures.conditions import until
from tests.fixtures.stack import Stack


def _base(stack: Stack) -> str:
    return str(stack.gateway.make_url("")).rstrip("/")


async def _report(stack: Stack, session: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.post(
        f"{_base(stack)}/v1/sessions/{session}/outcome", json={"success": True}
    ) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_the_admin_api_takes_and_shows_the_id_the_client_sent(stack: Stack) -> None:
    async with stack.client() as client:
        await Agent(client, "outcome-run-4").run(2)
    status, body = await _report(stack, "outcome-run-4")
    assert status == 200 and body["session_id"] == "outcome-run-4"
    status, shown = await admin(_base(stack), "/admin/sessions/outcome-run-4")
    assert status == 200 and shown["session_id"] == "outcome-run-4" and shown["outcome"]["success"] is True
    _, listed = await admin(_base(stack), "/admin/sessions")
    assert [s["session_id"] for s in listed["data"]] == ["outcome-run-4"]
    for missing in ("never-ran", "h:outcome-run-4"):  # the stored form is no name of it
        status, answer = await admin(_base(stack), f"/admin/sessions/{missing}")
        assert status == 404 and answer["error"]["code"] == "session_not_found"
        assert repr(missing) in answer["error"]["message"]


async def test_an_id_that_names_a_clients_session_and_the_gateways_is_a_404_saying_so(stack: Stack) -> None:
    """A session no client named goes by the gateway's name for it (p:…); a client that sends that very id as
    its x-session-id makes it name two sessions: neither is picked."""
    conversation = [{"role": "user", "content": "what is a monad?"}, {"role": "assistant", "content": "A monoid"},
                    {"role": "user", "content": "simpler?"}]
    async with stack.client() as client:
        await client.chat.completions.create(model="auto", messages=conversation)  # type: ignore[arg-type]

        async def derived() -> str | None:
            await stack.gateway.app[STATE].trajectories.flush()
            _, listed = await admin(_base(stack), "/admin/sessions")
            return listed["data"][0]["session_id"] if listed["data"] else None

        name = await until(derived, what="the derived session recorded")
        assert name.startswith("p:")
        status, _ = await admin(_base(stack), f"/admin/sessions/{name}")
        assert status == 200
        await Agent(client, name).run(1)
    await until(lambda: _listed(stack, 2), what="both sessions recorded")
    status, answer = await admin(_base(stack), f"/admin/sessions/{name}")
    assert status == 404 and answer["error"]["code"] == "session_ambiguous" and repr(name) in answer["error"]["message"]
    status, answer = await _report(stack, name)
    assert status == 404 and answer["error"]["code"] == "session_ambiguous"
    assert all(s["outcome"] is None for s in (await admin(_base(stack), "/admin/sessions"))[1]["data"])


async def _listed(stack: Stack, count: int) -> bool:
    _, listed = await admin(_base(stack), "/admin/sessions")
    return len(listed["data"]) == count


async def test_a_session_shown_by_its_recorded_steps_is_found_with_the_id_shown(stack: Stack) -> None:
    async with stack.client() as client:
        await Agent(client, "a/b c:d").run(1)
    shown = await recorded(_base(stack), "a%2Fb%20c:d", 1)
    assert shown["session_id"] == "a/b c:d"
