"""Rows of the labelled set from our own runs of the real coding agents: `python -m evals.tool_outcomes.agent_runs`.

Codex CLI and Claude Code (the pinned npm builds the suite installs) each run one session against a fake vLLM
scripted to call their shell tool once per command of build.COMMANDS (and `cat` of a sample of this repository's
modules); each agent really runs the command in this repository and sends its result back in its next request.
A row is that result as the agent's next request carried it (Codex's `function_call_output` text, Claude Code's
`tool_result` content and its `is_error` flag); the label is the exit code Codex reports for its own run
(`command_execution.exit_code` in its events), and for Claude Code, which reports none, the command's exit code
under bash here. The model's tool calls are scripted because the random-weight pair of `up` calls no tools; the
commands, their execution and the agents' own formatting are real.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from aiohttp import web

from evals.tool_outcomes.build import COMMANDS, FIXTURES, OUT, ROOT, _git, _run, cap
from fakes.faulty_vllm import FakeVLLM, ToolUse
from tests.fixtures import agent_clients

AGENTS = {"codex": "codex-cli 0.169.0", "claude-code": "claude-code 2.1.332"}
MODULES_SAMPLED = 24  # `cat` of every 6th gateway module: exit 0 texts full of code and its error words
TURN_BOUND_S = 600.0


def commands(tmp: str) -> list[str]:
    modules = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "gateway").rglob("*.py"))[::6][:MODULES_SAMPLED]
    return [f"cat {m}" for m in modules] + [
        c.replace("python3", sys.executable).replace("{tmp}", tmp) for c in COMMANDS]


async def _serve(fake: FakeVLLM) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(fake.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def _tool_use(agent: str, command: str) -> ToolUse:
    shell = f"cd {ROOT} && {command}"
    if agent == "codex":
        return ToolUse("exec_command", {"cmd": shell})
    return ToolUse("Bash", {"command": shell, "description": "Run the command"})


async def run_agent(agent: str, cmds: list[str], folder: Path) -> tuple[list[dict[str, Any]], list[int | None]]:
    """The tool results the agent sent back, one per command in order, and the exit codes it reported."""
    fake = FakeVLLM("fake")
    fake.script = [_tool_use(agent, c) for c in cmds] + ["Done."]
    runner, url = await _serve(fake)
    try:
        if agent == "codex":
            done = await agent_clients.codex_exec(url + "/v1", "Run the commands.", folder, model="fake",
                                                  timeout_s=TURN_BOUND_S)
        else:
            done = await agent_clients.claude_print(url, "Run the commands.", folder, model="fake",
                                                    timeout_s=TURN_BOUND_S)
    finally:
        await runner.cleanup()
    if done.exit_code != 0:
        raise SystemExit(f"{agent} failed: {done.describe()}")
    reported = [e["item"].get("exit_code") for e in done.events()
                if e.get("type") == "item.completed" and e.get("item", {}).get("type") == "command_execution"]
    return _results(agent, fake.received[-1]), reported


def _results(agent: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The tool results of the session's last request (it holds every earlier one), in order."""
    if agent == "codex":
        return [{"text": item["output"] if isinstance(item["output"], str) else json.dumps(item["output"])}
                for item in body["input"] if item.get("type") == "function_call_output"]
    found = []
    for message in body["messages"]:
        for block in message["content"] if isinstance(message["content"], list) else ():
            if block.get("type") == "tool_result":
                content = block.get("content")
                text = content if isinstance(content, str) else "\n".join(
                    part.get("text", "") for part in content or () if isinstance(part, dict))
                found.append({"text": text, "is_error": bool(block.get("is_error"))})
    return found


def rows(agent: str, cmds: list[str], results: list[dict[str, Any]], reported: list[int | None], tmp: str,
         commit: str) -> Iterator[dict[str, Any]]:
    assert len(results) == len(cmds), f"{agent}: {len(results)} results for {len(cmds)} commands"
    for i, (command, result) in enumerate(zip(cmds, results, strict=True)):
        code = reported[i] if i < len(reported) and reported[i] is not None else _run(command, ROOT)[0]
        yield {"source": agent, "client": AGENTS[agent], "repo": "agent-gateway", "commit": commit,
               "command": command.replace(tmp, "/tmp/fixtures").replace(sys.executable, "python3"),
               "exit_code": code,
               "text": cap(result["text"].replace(tmp, "/tmp/fixtures")),
               **({"is_error": result["is_error"]} if "is_error" in result else {})}


async def collect() -> list[dict[str, Any]]:
    commit = _git(ROOT, "rev-parse", "HEAD").strip()
    found: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in FIXTURES.items():
            (Path(tmp) / name).write_text(text)
        cmds = commands(tmp)
        for agent in AGENTS:
            results, reported = await run_agent(agent, cmds, Path(tmp) / agent)
            found += rows(agent, cmds, results, reported, tmp, commit)
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.parse_args(argv)
    added = asyncio.run(collect())
    with gzip.open(OUT, "rt", encoding="utf-8") as old:
        kept = [line for line in old if json.loads(line)["source"] not in AGENTS]
    lines = "".join(kept) + "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in added)
    with gzip.GzipFile(OUT, "wb", mtime=0) as out:
        out.write(lines.encode("utf-8"))
    print(f"{len(added)} rows from the agents' own runs added -> {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
