"""Codex CLI and Claude Code, the real clients from the npm registry, through the gateway to the fake pair.

The random-weight vLLM pair does not emit tool calls, so these multi-step loops run against the fake vLLM,
scripted to call a tool: each agent runs the tool on this machine and continues with its result. The gateway
routes each step by the default policy (planning to hq, the routine tool-result step to fast) and records the
run as one agent session, named by what the client sends (Codex's `session-id`, Claude Code's
`X-Claude-Code-Session-Id`), with its steps, tool calls and tool results.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from fakes.faulty_vllm import ToolUse
from tests.fixtures import agent_clients
from tests.fixtures.conditions import until
from tests.fixtures.stack import ADMIN_TOKEN, Stack

DEFAULT = yaml.safe_load((Path(__file__).resolve().parents[2] / "policies" / "default.yaml").read_text())
RULES = yaml.safe_dump({"rules": DEFAULT["rules"]})
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


async def _admin(stack: Stack, path: str) -> Any:
    async with aiohttp.ClientSession() as http, http.get(stack.gateway.make_url(path), headers=ADMIN) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def _one_session(stack: Stack, steps: int) -> dict[str, Any]:
    """The only recorded session, once it holds `steps` steps, with its timeline."""

    async def recorded() -> Any:
        listed = (await _admin(stack, "/admin/sessions"))["data"]
        return listed if len(listed) == 1 and listed[0]["steps"] == steps else None

    (summary,) = await until(recorded, timeout_s=30.0, what=f"one session of {steps} steps")
    return dict(await _admin(stack, f"/admin/sessions/{summary['session_id']}?tenant={summary['tenant']}"))


async def test_codex_exec_runs_a_turn_through_the_gateway(make_stack: Any, tmp_path: Path) -> None:
    stack: Stack = await make_stack(rules=RULES)
    stack.hq.script = [ToolUse("exec_command", {"cmd": "echo clue-$((6 * 7))"})]  # the planning step's answer
    run = await agent_clients.codex_exec(stack.base_url, "Print the clue.", tmp_path, model="auto")
    assert run.exit_code == 0, run.describe()
    assert len(stack.hq.received) == 1 and len(stack.fast.received) == 1  # planned on hq, the routine step on fast
    results = [i for i in stack.fast.received[0]["input"] if i.get("type") == "function_call_output"]
    assert len(results) == 1 and "clue-42" in json.dumps(results[0]["output"])  # the command ran here
    session = await _one_session(stack, 2)
    assert session["session_id"] == stack.hq.headers_seen[0]["session-id"]
    first, second = session["steps"]
    assert (first["deployment"], second["deployment"]) == ("hq", "fast")
    assert [c["name"] for c in first["tool_calls"]] == ["exec_command"]
    assert len(second["tool_results"]) == 1 and second["tool_results"][0]["ok"]


async def test_claude_code_runs_a_turn_through_the_gateway(make_stack: Any, tmp_path: Path) -> None:
    stack: Stack = await make_stack(rules=RULES)
    stack.hq.script = [ToolUse("Bash", {"command": "echo clue-$((6 * 7))", "description": "Print the clue"})]
    run = await agent_clients.claude_print(stack.gateway_root, "Print the clue.", tmp_path, model="auto")
    assert run.exit_code == 0, run.describe()
    steps = [b for fake in (stack.hq, stack.fast) for p, b in zip(fake.paths, fake.received, strict=True)
             if p == "/v1/messages" and b.get("tools")]
    assert len(steps) == 2
    results = [block for block in steps[1]["messages"][-1]["content"]
               if isinstance(block, dict) and block.get("type") == "tool_result"]
    assert len(results) == 1 and "clue-42" in json.dumps(results[0]["content"])  # Bash ran here
    final = [e for e in run.events() if e.get("type") == "result"]
    assert final, run.describe()
    session = await _one_session(stack, 2)
    assert session["session_id"] == final[0]["session_id"]
    first, second = session["steps"]
    assert (first["deployment"], second["deployment"]) == ("hq", "fast")
    assert [c["name"] for c in first["tool_calls"]] == ["Bash"]
    assert len(second["tool_results"]) == 1


async def test_codex_compacts_through_the_gateway_and_goes_on(make_stack: Any, tmp_path: Path) -> None:
    """Codex's built-in OpenAI provider pointed at the gateway, with a tiny auto-compact limit: after the tool
    step it compacts (remote compaction v2: a compaction_trigger), the gateway's summary comes back as one
    compaction item, and Codex goes on with it to the end of its turn."""
    stack: Stack = await make_stack(settings={"compaction_key": "k" * 40})
    stack.fast.answer = lambda body: "## Goal\nPrint the clue.\n## Next step\nSay it is done."
    stack.fast.script = [ToolUse("exec_command", {"cmd": "echo clue-$((6 * 7))"}), "All done."]
    run = await agent_clients.codex_exec(stack.base_url, "Print the clue.", tmp_path, model="fast",
                                         provider="openai", auto_compact_tokens=15)
    assert run.exit_code == 0, run.describe()
    messages = [e["item"]["text"] for e in run.events() if e.get("type") == "item.completed"
                and e["item"].get("type") == "agent_message"]
    assert messages == ["All done."]
    # the first step, the summary the gateway asked for, the step after the compaction
    assert stack.fast.paths == ["/v1/responses", "/v1/chat/completions", "/v1/responses"]
    after = stack.fast.received[-1]["input"]
    assert all(item.get("type") not in ("compaction", "compaction_trigger") for item in after)
    assert "Say it is done." in json.dumps(after)
    async with aiohttp.ClientSession() as http, http.get(stack.gateway.make_url("/metrics")) as resp:
        text = await resp.text()
    assert 'gateway_compactions_total{api="responses",deployment="fast",trigger="v2_trigger"} 1.0' in text


SUMMARY = "<analysis>One clue printed.</analysis>\n<summary>1. Primary Request: print the clue twice.</summary>"


def _summary_or_done(body: dict[str, Any]) -> str:
    """The fake's text: a summary for Claude Code's summary request, else the end of the turn."""
    asked = "create a detailed summary of the conversation" in json.dumps(body["messages"][-1])
    return SUMMARY if asked else "All done."


def _context_reported(body: dict[str, Any]) -> int:
    """90k of a 100k window before the compaction (over Claude Code's threshold), 5k after it: a context that
    stays full after a compaction makes Claude Code stop as thrashing."""
    return 5_000 if "This session is being continued" in json.dumps(body["messages"][0]) else 90_000


async def test_claude_code_compacts_through_the_gateway_and_goes_on(make_stack: Any, tmp_path: Path) -> None:
    """Claude Code with a small auto-compact window: the deployments report a context near it, so Claude Code
    sends its own summary request; the gateway recognizes it (counted, charged and routed as one), and Claude
    Code goes on from the summary to the end of its turn."""
    stack: Stack = await make_stack(rules=RULES)
    stack.hq.script = [ToolUse("Bash", {"command": "echo clue-$((6 * 7))", "description": "Print the clue"})]
    stack.fast.script = [ToolUse("Bash", {"command": "echo again-$((6 * 7))", "description": "Print it again"})]
    for fake in (stack.hq, stack.fast):
        fake.prompt_tokens = _context_reported
        fake.answer = _summary_or_done
    run = await agent_clients.claude_print(stack.gateway_root, "Print the clue.", tmp_path, model="auto",
                                           auto_compact_window=100_000)
    assert run.exit_code == 0, run.describe()
    final = [e for e in run.events() if e.get("type") == "result"]
    assert final and final[0]["result"] == "All done.", run.describe()
    bodies = [b for fake in (stack.hq, stack.fast) for b in fake.received]
    summaries = [b for b in bodies if "create a detailed summary" in json.dumps(b["messages"][-1])]
    continued = [b for b in bodies if "This session is being continued" in json.dumps(b["messages"][0])]
    assert summaries and continued, [json.dumps(b["messages"][-1])[:200] for b in bodies]
    async with aiohttp.ClientSession() as http, http.get(stack.gateway.make_url("/metrics")) as resp:
        text = await resp.text()
    counted = [line for line in text.splitlines()
               if line.startswith('gateway_agent_compaction_requests_total{agent="claude-code"')]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in counted) == len(summaries), counted
    charged = [line for line in text.splitlines()
               if line.startswith('gateway_compaction_cost_usd_total{deployment=') and 'trigger="claude-code"' in line]
    assert charged and all(float(line.rsplit(" ", 1)[1]) > 0 for line in charged), charged
