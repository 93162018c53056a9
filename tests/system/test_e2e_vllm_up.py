"""`up` end to end: real vLLM pair + gateway come up, answer, and SIGTERM leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from serving.launcher import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def descendants(pid: int) -> set[int]:
    """Every live process below pid, by walking parent links in /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The command name may hold spaces and parentheses; the fields after its last ')' are safe.
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: set[int] = set()
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def wait_for_line(process: subprocess.Popen[str], prefix: str, timeout_s: float) -> str:
    assert process.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if line.startswith(prefix):
            return line.strip()
        if not line and process.poll() is not None:
            pytest.fail(f"up exited with {process.returncode} before printing {prefix!r}")
    pytest.fail(f"up printed no {prefix!r} line within {timeout_s} s")


@pytest.mark.usefixtures("vllm_machine_free")
def test_up_serves_then_sigterm_leaves_no_orphans(tmp_path: Path) -> None:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "serving.up", "--profile", "cpu", "--port", str(port),
         "--state-dir", str(tmp_path / "state"), "--model-dir", str(tmp_path / "model")],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    children: set[int] = set()
    try:
        started = time.monotonic()
        endpoint = wait_for_line(process, "gateway: ", 600.0)
        print(f"up ready in {time.monotonic() - started:.0f} s: {endpoint}", file=sys.stderr)
        assert endpoint == f"gateway: http://127.0.0.1:{port}/v1"
        # Answers take well under a second, but on a shared machine at a load average of 70 one took over 60 s.
        client = openai.OpenAI(
            base_url=endpoint.split(" ", 1)[1], api_key="none", timeout=240.0, max_retries=0
        )
        reply = client.chat.completions.create(
            model="hq", messages=[{"role": "user", "content": "Hello!"}], max_tokens=4
        )
        assert reply.model == "tiny-hq"
        # A tool-using agent's step and its tool-result turn: vLLM serves them with auto tool choice on.
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
        ask = [{"role": "user", "content": "What is the weather in Paris?"}]
        step = client.chat.completions.create(model="auto", messages=ask, tools=tools, max_tokens=4)
        call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
        result = {"role": "tool", "tool_call_id": "c1", "content": "18 C"}
        turn = [*ask, {"role": "assistant", "tool_calls": [call]}, result]
        answer = client.chat.completions.create(model="auto", messages=turn, tools=tools, max_tokens=4)
        assert {step.model, answer.model} <= {"tiny-hq", "tiny-fast"}
        children = descendants(process.pid)
        # gateway + 2 vLLM API servers + their engine cores (and helpers): several processes.
        assert len(children) >= 5, children
        os.kill(process.pid, signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(pid) for pid in children):
            time.sleep(0.2)
        assert not [pid for pid in children if alive(pid)]
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
        # Belt and braces for a failed run: nothing this test started may outlive it.
        for pid in children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
