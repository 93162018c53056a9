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
        outputs = {3: "Error: quota", 5: "Exit code: 0\nOutput:\nerror.log"}
        await Agent(client, "long", output=lambda i: outputs.get(i, "2 notes")).run(7)
        await Agent(client, "short").run(1)
    await recorded(base, "long", 7)
    await recorded(base, "short", 1)
    capsys.readouterr()

    assert await _cli(base, "sessions", "list", "--sort", "steps") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["SESSION", "TENANT", "STEPS"]
    assert [line.split()[0] for line in lines[1:]] == ["long", "short"]
    assert lines[1].split()[1:3] == ["anonymous", "7"] and "hq 7" in lines[1]
    assert lines[1].rstrip().endswith("loop:repeated_tool_call") and lines[2].rstrip().endswith("-")

    assert await _cli(base, "sessions", "show", "long") == 0
    out = capsys.readouterr().out
    assert out.startswith("session long (tenant anonymous): 7 steps")
    steps = [line for line in out.splitlines()[4:] if not line.lstrip().startswith("!")]
    assert [int(line.split()[0]) for line in steps] == [1, 2, 3, 4, 5, 6, 7]
    assert "-> search(args " in steps[0] and "<- call_3 ERROR [error_line] (12 chars)" in steps[3]
    assert "<- call_1 ok [none] (7 chars)" in steps[1] and "<- call_5 ok [exit_code 0] (30 chars)" in steps[5]
    assert "! loop:repeated_tool_call" in out

    assert await _cli(base, "sessions", "show", "long", "--json") == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["step_count"] == 7 and len(shown["steps"]) == 7
    assert shown["steps"][5]["tool_results"] == [
        {"tool_call_id": "call_5", "ok": True, "size": 30, "source": "exit_code", "exit_code": 0}]


async def test_an_unknown_session_is_one_clear_line_and_exit_2(
    make_stack: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    stack = await make_stack()
    base = str(stack.gateway.make_url("")).rstrip("/")
    assert await _cli(base, "sessions", "show", "nobody") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: GET ") and "HTTP 404" in err and "[session_not_found]" in err
    assert len(err.splitlines()) == 1


async def _run(client: Any, session: str, task: str, model: str, steps: int = 2) -> None:
    agent = Agent(client, session, model=model)
    agent.messages[1]["content"] = f"{task}: find the launch code hidden in the notes"
    await agent.run(steps)


async def _report(base: str, session: str, success: bool, task: str) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as http, http.post(
        f"{base}/v1/sessions/{session}/outcome", json={"success": success, "labels": {"task": task}}
    ) as resp:
        assert resp.status == 200, await resp.text()


async def test_outcomes_are_listed_shown_and_exported_as_labels_classifier_train_takes(
    make_stack: Callable[..., Any], capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    stack = await make_stack(settings={"request_log_prompts": 1})
    base = str(stack.gateway.make_url("")).rstrip("/")
    runs = [("t1-fast", "t1", "fast", False), ("t1-hq", "t1", "hq", True),  # failed on fast, rerun solved on hq
            ("t2-fast", "t2", "fast", True),  # fast was enough
            ("t3-fast", "t3", "fast", False)]  # failed, never rerun on hq: no label
    async with stack.client() as client:
        for session, task, model, _ in runs:
            await _run(client, session, task, model)
        await _run(client, "no-outcome", "t4", "fast")
    for session, task, _, success in runs:
        await _report(base, session, success, task)
    await recorded(base, "no-outcome", 2)
    capsys.readouterr()

    assert await _cli(base, "sessions", "list") == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert " failure " in lines["t1-fast"] and " success " in lines["t1-hq"] and " - " in lines["no-outcome"]
    assert await _cli(base, "sessions", "show", "t1-fast") == 0
    out = capsys.readouterr().out
    assert "  outcome: failure, via api at " in out and "after 2 steps" in out and "[task=t1]" in out

    labels = tmp_path / "labels.jsonl"
    assert await _cli(base, "sessions", "export", "--with-outcomes", "--out", str(labels)) == 0
    summary = capsys.readouterr().out
    assert summary.startswith("5 sessions: 4 label rows from sessions labelled tie 1, weak_worse 1")
    rows = [json.loads(line) for line in labels.read_text().splitlines()]
    by_session = {(r["session_id"], r["verdict"], r["q_strong"], r["q_weak"]) for r in rows}
    assert by_session == {("t1-fast", "weak_worse", 1.0, 0.0), ("t2-fast", "tie", 1.0, 1.0)}
    assert all(r["body"]["messages"][0]["content"].startswith(r["task"][5:]) for r in rows)
    assert "1 failed, and no run of the task succeeded on the strong deployment" in summary
    model = tmp_path / "learned.json"
    code = await asyncio.to_thread(main, ["classifier", "train", "--labels", str(labels), "--out", str(model)])
    assert code == 0 and json.loads(model.read_text())["meta"]["label_rows"] == 4

    plain = tmp_path / "sessions.jsonl"
    assert await _cli(base, "sessions", "export", "--out", str(plain)) == 0
    exported = [json.loads(line) for line in plain.read_text().splitlines()]
    assert len(exported) == 5 and all("steps" in s and "outcome" in s for s in exported)


# --- one session id for users (issue 32, item 2) ---


async def test_the_id_the_client_sent_is_the_id_every_sessions_command_takes_and_shows(
    make_stack: Callable[..., Any], capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    stack = await make_stack()
    base = str(stack.gateway.make_url("")).rstrip("/")
    async with stack.client() as client:
        await Agent(client, "outcome-run-4").run(2)
    await _report(base, "outcome-run-4", True, "t1")  # the outcome API takes the client's id
    capsys.readouterr()

    assert await _cli(base, "sessions", "show", "outcome-run-4") == 0
    out = capsys.readouterr().out
    assert out.startswith("session outcome-run-4 (tenant anonymous): 2 steps") and "outcome: success" in out
    assert await _cli(base, "sessions", "list") == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]] == ["outcome-run-4"]
    exported = tmp_path / "sessions.jsonl"
    assert await _cli(base, "sessions", "export", "--out", str(exported)) == 0
    assert [json.loads(line)["session_id"] for line in exported.read_text().splitlines()] == ["outcome-run-4"]
    capsys.readouterr()

    # the stored form is internal: it names no session, and the answer says which id to use
    assert await _cli(base, "sessions", "show", "h:outcome-run-4") == 2
    err = capsys.readouterr().err
    assert "HTTP 404" in err and "'h:outcome-run-4'" in err and "here 'outcome-run-4'" in err
    assert "[session_not_found]" in err


async def test_an_id_two_tenants_sent_is_ambiguous_until_the_tenant_is_named(
    make_stack: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    import openai

    from gateway.accounting import keys
    from gateway.server.resources import STATE

    stack = await make_stack("auth: {enabled: true}\n")
    base = str(stack.gateway.make_url("")).rstrip("/")
    for tenant, steps in (("acme", 1), ("globex", 2)):
        _, key = await keys.create(stack.gateway.app[STATE].accounting.store, tenant)
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key=key, max_retries=0) as client:
            await Agent(client, "run-1").run(steps)
    await recorded(base, "run-1?tenant=globex", 2)
    await recorded(base, "run-1?tenant=acme", 1)
    capsys.readouterr()

    assert await _cli(base, "sessions", "show", "run-1") == 2
    err = capsys.readouterr().err
    assert "HTTP 404" in err and "'run-1'" in err and "'acme', 'globex'" in err and "[session_ambiguous]" in err
    assert await _cli(base, "sessions", "show", "run-1", "--tenant", "globex") == 0
    assert capsys.readouterr().out.startswith("session run-1 (tenant globex): 2 steps")


async def test_sessions_show_says_what_a_compaction_cost_and_who_asked(
    make_stack: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.server.test_compaction import CONVERSATION, KEY, _summarizer

    stack = await make_stack(settings={"compaction_key": KEY})
    _summarizer(stack)
    settings: Any = {"context_management": [{"type": "compaction", "compact_threshold": 5}]}
    async with stack.client() as client:
        await client.responses.create(model="fast", input=CONVERSATION, extra_body=settings,  # type: ignore[arg-type]
                                      extra_headers={"x-session-id": "compacted-run"})
    base = str(stack.gateway.make_url("")).rstrip("/")
    await recorded(base, "compacted-run", 1)
    capsys.readouterr()
    assert await _cli(base, "sessions", "show", "compacted-run") == 0
    shown = capsys.readouterr().out
    summary_usd = (11 * 0.5 + stack.fast.chunks * 1.5) / 1e6
    assert f"compaction by context_management: {summary_usd:.6f} USD of the step's cost" in shown
