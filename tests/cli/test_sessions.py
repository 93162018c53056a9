"""`agent-gateway sessions list|show` against a running gateway that recorded real agent sessions."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

from gateway.cli.command import main
from tests.fixtures.agent_runs import Agent, recorded
from tests.fixtures.stack import ADMIN_TOKEN

LOOPS = """
agents:
  loops:
    repeated_tool_call: {count: 3, window_steps: 5}
"""


async def _cli(base: str, *args: str) -> int:
    # the CLI blocks on urllib: run it beside the event loop that serves the gateway
    return await asyncio.to_thread(main, [*args, "--url", base, "--admin-token", ADMIN_TOKEN])


async def test_sessions_list_and_show_print_the_recorded_runs(
    make_stack: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    stack = await make_stack(LOOPS)
    stack.hq.tool_args = lambda n: {"query": "launch code", "page": n if n <= 3 else 9}  # stuck from step 4
    base = str(stack.gateway.make_url("")).rstrip("/")
    async with stack.client() as client:
        await Agent(client, "long", output=lambda i: "Error: quota" if i == 3 else "2 notes").run(7)
        await Agent(client, "short").run(1)
    await recorded(base, "h:long", 7)
    await recorded(base, "h:short", 1)
    capsys.readouterr()

    assert await _cli(base, "sessions", "list", "--sort", "steps") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["SESSION", "TENANT", "STEPS"]
    assert [line.split()[0] for line in lines[1:]] == ["h:long", "h:short"]
    assert lines[1].split()[1:3] == ["anonymous", "7"] and "hq 7" in lines[1]
    assert lines[1].rstrip().endswith("loop:repeated_tool_call") and lines[2].rstrip().endswith("-")

    assert await _cli(base, "sessions", "show", "h:long") == 0
    out = capsys.readouterr().out
    assert out.startswith("session h:long (tenant anonymous): 7 steps")
    steps = [line for line in out.splitlines()[3:] if not line.lstrip().startswith("!")]
    assert [int(line.split()[0]) for line in steps] == [1, 2, 3, 4, 5, 6, 7]
    assert "-> search(args " in steps[0] and "<- call_3 ERROR (12 chars)" in steps[3]
    assert "! loop:repeated_tool_call" in out

    assert await _cli(base, "sessions", "show", "h:long", "--json") == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["step_count"] == 7 and len(shown["steps"]) == 7


async def test_an_unknown_session_is_one_clear_line_and_exit_2(
    make_stack: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    stack = await make_stack()
    base = str(stack.gateway.make_url("")).rstrip("/")
    assert await _cli(base, "sessions", "show", "h:nobody") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: GET ") and "HTTP 404" in err and "[session_not_found]" in err
    assert len(err.splitlines()) == 1
