"""The default policy on a coding agent's steps, asked as `policy explain` asks it (the chat view of each step).

Codex's and Claude Code's steps carry 10-20k prompt tokens (instructions and tool definitions, the same on
every step) and are still routine: a tool result fed back goes to fast, planning and trouble go to hq.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.cli.explain import offline

DEFAULT_POLICY = str(Path(__file__).resolve().parents[2] / "policies" / "default.yaml")
TOOL_NAMES = ("exec_command", "write_stdin", "apply_patch", "view_image", "read", "edit", "write", "grep", "glob")


def _tools(description_words: int) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {
        "name": name, "description": " ".join(f"{name}-detail-{i}" for i in range(description_words)),
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}}
        for name in TOOL_NAMES]


def _agent_body(prompt_kilotokens: int, tail: list[dict[str, Any]]) -> dict[str, Any]:
    """A coding agent's request: long instructions and tools, the task, then the steps so far."""
    instructions = "\n".join(f"Rule {i}: keep edits small, run the tests, explain what changed." for i in range(
        prompt_kilotokens * 50))
    return {"model": "auto", "stream": True, "tools": _tools(80),
            "messages": [{"role": "system", "content": instructions},
                         {"role": "user", "content": "Fix the failing test in tests/test_parser.py."}, *tail]}


def _call(cmd: str, call_id: str) -> dict[str, Any]:
    function = {"name": "exec_command", "arguments": json.dumps({"cmd": cmd})}
    call = {"id": call_id, "type": "function", "function": function}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def _result(text: str, call_id: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


ROUTINE = [_call("ls tests", "1"), _result("test_parser.py\ntest_lexer.py", "1")]
FAILED = [_call("pytest -q tests/test_parser.py", "2"), _result("Error: exit status 1: 1 failed", "2")]
REPEATED = [_call("git status", f"s{i}") if j == 0 else _result("nothing to commit", f"s{i}")
            for i in range(3) for j in range(2)]


@pytest.mark.parametrize("prompt_kilotokens", [10, 20])
@pytest.mark.parametrize(("tail", "deployment", "rule"), [
    ([], "hq", "planning-to-hq"),
    (ROUTINE, "fast", "routine-tool-step-to-fast"),
    (ROUTINE + FAILED, "hq", "tool-error-to-hq"),
    (ROUTINE + REPEATED, "hq", "repeated-call-to-hq"),
    (ROUTINE + FAILED + [_call("pytest -q -x", "3"), _result("1 passed", "3")], "fast", "routine-tool-step-to-fast"),
])
def test_a_coding_agents_routine_step_goes_to_fast_and_trouble_to_hq(
    tmp_path: Path, prompt_kilotokens: int, tail: list[dict[str, Any]], deployment: str, rule: str
) -> None:
    request = tmp_path / "request.json"
    request.write_text(json.dumps(_agent_body(prompt_kilotokens, tail)))
    report = offline(DEFAULT_POLICY, str(request), "chat", [], None, [])
    tokens = report["features"]["prompt_tokens"]
    assert prompt_kilotokens * 1000 * 0.8 < tokens < prompt_kilotokens * 1000 * 1.3  # the size it stands for
    assert (report["deployment"], report["rule"]) == (deployment, rule), report["reasons"]
