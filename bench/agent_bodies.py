"""Coding agents' chat bodies for the load benchmarks: the gateway's real traffic, 100 KB and 180 KB a step.

    steps = agent_bodies.steps("agent-100k", stream=False)     [(body bytes, session name), ...]
    .venv/bin/python -m bench.agent_bodies                     prints each kind's sizes and shape

A step is what Codex or Claude Code sends through Chat Completions: a long system prompt of instructions, 24 tools
with JSON schemas, the task, then 30-60 tool calls (shell commands, file reads, patches, searches) each followed by
its result (source files, pytest and git output, listings; some fail, with the harness's `Exit code: N` header or
pytest's summary as the agents write them), ending on a tool result. Each kind holds SESSIONS sessions of STEPS
steps: a session's step re-sends the step before it plus one more call and result, as an agent does, so what a
gateway keys by the prompt's prefix sees what it would in production, and no two sessions share text past the tool
schemas. Deterministic: the same bytes every run.
"""

from __future__ import annotations

import json
import random
from typing import Any

# A step's body size, about (a session's steps span +-12 KB), and its system prompt's characters.
KINDS = {"agent-100k": (100 * 1024, 6_000), "agent-180k": (180 * 1024, 24_000)}
SESSIONS = 8
STEPS = 8

_WORDS = ("request", "session", "router", "policy", "deployment", "window", "token", "cache", "prefix", "budget",
          "stream", "event", "header", "body", "count", "limit", "state", "store", "record", "chain", "link",
          "digest", "score", "rule", "step", "tool", "result", "error", "config", "path", "buffer", "queue")
_VERBS = ("read", "write", "parse", "check", "build", "load", "send", "count", "merge", "split", "render", "find",
          "match", "update", "close", "open", "flush", "keep", "drop", "wait")
_INSTRUCTIONS = (
    "You are a coding agent running in a terminal on the user's machine. You and the user share one workspace; "
    "your job is to finish the user's task end to end: read the code, make the change, run the tests, and report.",
    "Before each group of tool calls, say in one sentence what you are about to do and why. Group related reads "
    "together; do not narrate every file you open.",
    "Prefer `rg` over `grep` and `rg --files` over `find`: they are faster and respect .gitignore. Read files in "
    "chunks of at most 250 lines; a file you have read is still in your context, do not read it again.",
    "Edit files with the apply_patch tool. Each patch names its files with `*** Update File:` and holds hunks "
    "with three lines of context; never rewrite a whole file to change a few lines, and never use sed -i.",
    "Keep changes minimal and consistent with the codebase's style. Fix the problem at its root cause rather than "
    "applying surface-level patches. Do not fix unrelated bugs or broken tests; mention them in your final message.",
    "Run the project's own checks after a change: its tests for the files you touched first, then the linter and "
    "the type checker if the project has them. If a command fails, read its output before you try again.",
    "Never run destructive commands (git reset --hard, rm -rf, git checkout -- on files you did not change) "
    "unless the user asked for them explicitly. The user may have uncommitted work in the tree.",
    "When you are done, write a short summary: what you changed and where (file paths with line numbers), how "
    "you checked it, and anything left for the user. Use plain sentences, no headings for short answers.",
    "Sandboxing: commands run with workspace-write access; network access is off. A command that needs more asks "
    "the user for approval with a one-line justification; do not retry a refused command in another form.",
    "Planning: for a task of several steps keep a plan with update_plan (one step in progress at a time) and mark "
    "each step completed as soon as it is done; skip the plan for a simple question or a one-file fix.",
)
_TOOL_NAMES = ("shell", "read_file", "write_file", "apply_patch", "grep", "glob", "list_dir", "web_fetch",
               "todo_write", "task", "notebook_edit", "bash_output", "kill_shell", "edit", "multi_edit",
               "search_code", "run_tests", "git_status", "git_diff", "git_log", "view_image", "update_plan",
               "ask_user", "exit_plan_mode")


def _sentence(rng: random.Random, words: int) -> str:
    text = " ".join(rng.choice(_WORDS + _VERBS) for _ in range(words))
    return text[0].upper() + text[1:] + "."


def system_prompt(rng: random.Random, chars: int) -> str:
    """Instructions in the shape agents send (sections of rules and examples), about `chars` long."""
    parts: list[str] = []
    size = 0
    while size < chars:
        section = f"## {rng.choice(_VERBS).title()} the {rng.choice(_WORDS)}s\n\n"
        section += "\n".join(f"- {rng.choice(_INSTRUCTIONS)} {_sentence(rng, 14)}" for _ in range(5)) + "\n\n"
        parts.append(section)
        size += len(section)
    return "".join(parts)


def tools(rng: random.Random) -> list[dict[str, Any]]:
    """24 function tools with JSON-schema parameters and long descriptions, as Claude Code's list has them."""
    found = []
    for name in _TOOL_NAMES:
        properties: dict[str, Any] = {
            "path": {"type": "string", "description": "Absolute path of the file or folder. " + _sentence(rng, 10)},
            "command": {"type": "array", "items": {"type": "string"}, "description": _sentence(rng, 16)},
            "timeout_ms": {"type": "integer", "minimum": 1, "maximum": 600000, "description": _sentence(rng, 8)},
        }
        for extra in range(rng.randint(1, 4)):
            properties[f"{rng.choice(_WORDS)}_{extra}"] = {
                "type": rng.choice(("string", "boolean", "integer")), "description": _sentence(rng, 12)}
        found.append({"type": "function", "function": {
            "name": name, "description": " ".join(_sentence(rng, 18) for _ in range(rng.randint(2, 5))),
            "parameters": {"type": "object", "properties": properties, "required": ["path"],
                           "additionalProperties": False}}})
    return found


def _identifier(rng: random.Random) -> str:
    return f"{rng.choice(_VERBS)}_{rng.choice(_WORDS)}"


def source_file(rng: random.Random, lines: int) -> str:
    """A Python module's text, with the line numbers a read tool prefixes."""
    out = [f'"""{_sentence(rng, 12)}"""', "", "from __future__ import annotations", "",
           "import asyncio", "from dataclasses import dataclass", ""]
    while len(out) < lines:
        name, arg = _identifier(rng), rng.choice(_WORDS)
        out += ["", f"def {name}({arg}: dict[str, Any], limit: int = {rng.randint(1, 4096)}) -> int:",
                f'    """{_sentence(rng, 10)}"""',
                f"    found = {arg}.get({rng.choice(_WORDS)!r})",
                "    if found is None:",
                f"        raise ValueError(f\"no {rng.choice(_WORDS)} in {{{arg}!r}}\")",
                "    for item in found[:limit]:",
                f"        if item.{rng.choice(_WORDS)} > {rng.randint(0, 99)}:",
                f"            return {_identifier(rng)}(item)",
                f"    return len(found)  # {_sentence(rng, 6)}"]
    return "\n".join(f"{i + 1:6}\t{line}" for i, line in enumerate(out[:lines]))


def _pytest_output(rng: random.Random, failed: bool) -> str:
    tests = [f"tests/test_{rng.choice(_WORDS)}.py::test_{_identifier(rng)}" for _ in range(rng.randint(8, 30))]
    lines = ["============================= test session starts ==============================",
             "platform linux -- Python 3.11.9, pytest-8.3.2, pluggy-1.5.0",
             "rootdir: /home/dev/project", "configfile: pyproject.toml", f"collected {len(tests)} items", ""]
    lines += [f"{test} PASSED{' ' * 10}[{100 * (i + 1) // len(tests):3}%]" for i, test in enumerate(tests)]
    if failed:
        lines += ["", "=================================== FAILURES ===================================",
                  f"___________________________ {tests[0].split('::')[1]} ____________________________", "",
                  f"    def {tests[0].split('::')[1]}():", f">       assert {_identifier(rng)}(body) == 3",
                  "E       AssertionError: assert 2 == 3", "",
                  f"{tests[0].split('::')[0]}:{rng.randint(10, 400)}: AssertionError",
                  "=========================== short test summary info ============================",
                  f"FAILED {tests[0]} - AssertionError: assert 2 == 3",
                  f"========================= 1 failed, {len(tests) - 1} passed in 0.84s ========================="]
    else:
        lines.append(f"============================== {len(tests)} passed in 0.61s ===============================")
    return "\n".join(lines)


def _git_diff(rng: random.Random) -> str:
    path = f"gateway/{rng.choice(_WORDS)}/{rng.choice(_WORDS)}.py"
    lines = [f"diff --git a/{path} b/{path}", f"index {rng.getrandbits(28):07x}..{rng.getrandbits(28):07x} 100644",
             f"--- a/{path}", f"+++ b/{path}"]
    for _ in range(rng.randint(2, 5)):
        start = rng.randint(1, 400)
        lines.append(f"@@ -{start},7 +{start},8 @@ def {_identifier(rng)}(")
        lines += [f"     {_sentence(rng, 6)}" for _ in range(3)]
        lines += [f"-    return {_identifier(rng)}(found)", f"+    found = {_identifier(rng)}(found)",
                  "+    return found"]
        lines += [f"     {_sentence(rng, 6)}" for _ in range(3)]
    return "\n".join(lines)


def _grep_output(rng: random.Random) -> str:
    return "\n".join(f"gateway/{rng.choice(_WORDS)}/{rng.choice(_WORDS)}.py:{rng.randint(1, 500)}:    "
                     f"{_identifier(rng)}({rng.choice(_WORDS)}, {rng.choice(_WORDS)})"
                     for _ in range(rng.randint(10, 40)))


def _listing(rng: random.Random) -> str:
    return "\n".join(f"-rw-r--r--  1 dev dev {rng.randint(200, 40000):6} Mar {rng.randint(1, 28):2} "
                     f"{rng.randint(0, 23):02}:{rng.randint(0, 59):02} {rng.choice(_WORDS)}_{rng.choice(_WORDS)}.py"
                     for _ in range(rng.randint(10, 30)))


def _shell_result(rng: random.Random, output: str, code: int) -> str:
    """Codex's header over a command's output: what tool_outcomes reads the exit code from."""
    return (f"Exit code: {code}\nWall time: {rng.randint(1, 90) / 10} seconds\nTotal output lines: "
            f"{output.count(chr(10)) + 1}\nOutput:\n{output}")


def tool_round(rng: random.Random, index: int) -> list[dict[str, Any]]:
    """One assistant tool call and its result (one in eight fails)."""
    kind = rng.choice(("read", "read", "pytest", "diff", "grep", "ls", "patch"))
    failed = rng.random() < 0.125
    call_id = f"call_{index}_{rng.getrandbits(40):010x}"
    if kind == "read":
        path = f"/home/dev/project/gateway/{rng.choice(_WORDS)}/{rng.choice(_WORDS)}.py"
        name, arguments, result = "read_file", {"path": path, "offset": 1, "limit": 250}, source_file(
            rng, rng.randint(20, 70))
    elif kind == "patch":
        name, arguments = "apply_patch", {"input": "*** Begin Patch\n" + _git_diff(rng) + "\n*** End Patch"}
        result = _shell_result(rng, "Success. Updated the following files:\nM " + _identifier(rng) + ".py", 0)
    else:
        command = {"pytest": ["pytest", "-q", "tests/"], "diff": ["git", "diff"],
                   "grep": ["rg", "-n", _identifier(rng)], "ls": ["ls", "-la", "gateway/"]}[kind]
        output = {"pytest": lambda: _pytest_output(rng, failed), "diff": lambda: _git_diff(rng),
                  "grep": lambda: _grep_output(rng), "ls": lambda: _listing(rng)}[kind]()
        name, arguments = "shell", {"command": ["bash", "-lc", " ".join(command)], "workdir": "/home/dev/project"}
        result = _shell_result(rng, output, 1 if failed and kind == "pytest" else 0)
    said = _sentence(rng, 12) if rng.random() < 0.4 else None
    return [{"role": "assistant", "content": said, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]},
            {"role": "tool", "tool_call_id": call_id, "content": result}]


def session(seed: int, target_bytes: int, system_chars: int, steps: int = STEPS) -> list[dict[str, Any]]:
    """One session's `steps` bodies, each the one before plus a tool round; their sizes straddle target_bytes."""
    rng = random.Random(seed)
    head: list[dict[str, Any]] = [
        {"role": "system", "content": system_prompt(rng, system_chars)},
        {"role": "user", "content": f"<environment_context>\n  <cwd>/home/dev/project-{seed}</cwd>\n  "
                                    "<approval_policy>on-request</approval_policy>\n</environment_context>"},
        {"role": "user", "content": "The tests in tests/test_router.py fail since the last merge: find out why and "
                                    "fix it without changing the tests. " + _sentence(rng, 20)},
    ]
    body: dict[str, Any] = {"model": "auto", "messages": head, "tools": tools(rng), "max_tokens": 4096}
    rounds: list[list[dict[str, Any]]] = []
    size = len(json.dumps(body))
    while size < target_bytes - 12 * 1024 or len(rounds) < 30:  # the first step's size
        rounds.append(tool_round(rng, len(rounds)))
        size += len(json.dumps(rounds[-1])) + 2
    bodies = []
    for step in range(steps):
        if step:
            rounds.append(tool_round(rng, len(rounds)))
        bodies.append({**body, "messages": head + [m for r in rounds for m in r]})
    return bodies


def steps(kind: str, stream: bool) -> list[tuple[bytes, str]]:
    """Every session's steps as (body, session name), step-major: the sessions advance together, as agents do."""
    per_session = [session(1000 * (list(KINDS).index(kind) + 1) + s, *KINDS[kind]) for s in range(SESSIONS)]
    out = []
    for step in range(STEPS):
        for s, bodies in enumerate(per_session):
            body = {**bodies[step], "stream": True} if stream else bodies[step]
            out.append((json.dumps(body).encode(), f"bench-{kind}-{s}"))
    return out


def main() -> None:
    for kind in KINDS:
        found = steps(kind, False)
        sizes = sorted(len(raw) for raw, _ in found)
        body = json.loads(found[0][0])
        calls = sum(1 for m in body["messages"] if m.get("tool_calls"))
        print(f"{kind}: {len(found)} bodies, {sizes[0] / 1024:.0f}-{sizes[-1] / 1024:.0f} KiB "
              f"(median {sizes[len(sizes) // 2] / 1024:.0f}), first step: {len(body['messages'])} messages, "
              f"{len(body['tools'])} tools, {calls} tool calls, system prompt {len(body['messages'][0]['content'])} "
              f"chars")


if __name__ == "__main__":
    main()
