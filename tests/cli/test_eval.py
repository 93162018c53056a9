"""`agent-gateway eval` on a fake pair scripted to fail more often on hard cases: in-process gateways per policy
file, and a running gateway's routes with --url; every run's outcome goes through the outcome API."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fakes.faulty_vllm import FakeVLLM
from gateway.cli.command import main
from gateway.cli.eval_cases import Case, Run, check, load
from tests.fixtures.agent_runs import admin
from tests.fixtures.stack import Stack, policy_yaml

EXAMPLES = Path(__file__).resolve().parents[2] / "evals" / "examples.yaml"

CASES = """
cases:
""" + "".join(f"""
  - id: easy-{i}
    tags: [easy]
    prompt: Name the capital of France ({i}).
    expect: {{answer_contains: [Paris]}}
""" for i in range(5)) + "".join(f"""
  - id: hard-{i}
    tags: [hard]
    prompt: "hard: what is 123 * 47 ({i})? Use the calculator."
    tools:
      - name: calculator
        parameters: {{type: object, properties: {{expression: {{type: string}}}}}}
        result: "5781"
    expect: {{tool_called: [calculator], answer_contains: ["5781"]}}
""" for i in range(5))


def scripted(fake: FakeVLLM, wrong_on_hard: bool) -> None:
    """A deployment that calls the calculator once when offered it, then answers from its output (the fast
    one guesses instead on hard prompts)."""

    def message(body: dict[str, Any]) -> dict[str, Any]:
        messages = body["messages"]
        prompt = next(m["content"] for m in messages if m["role"] == "user")
        outputs = [m["content"] for m in messages if m["role"] == "tool"]
        if body.get("tools") and not outputs:
            call = {"id": "call_1", "type": "function",
                    "function": {"name": "calculator", "arguments": json.dumps({"expression": "123*47"})}}
            return {"role": "assistant", "content": None, "tool_calls": [call]}
        answer = outputs[-1] if outputs else "Paris"
        if wrong_on_hard and prompt.startswith("hard"):
            answer = "about 5000"
        return {"role": "assistant", "content": f"The answer is {answer}."}

    fake.message = message


@pytest.fixture
def pair_files(fake_pair: Any, tmp_path: Path) -> tuple[Path, Path, Path]:
    hq, hq_server, fast, fast_server = fake_pair
    scripted(hq, wrong_on_hard=False)
    scripted(fast, wrong_on_hard=True)
    text = policy_yaml(str(hq_server.make_url("")).rstrip("/"), str(fast_server.make_url("")).rstrip("/"),
                       rules="rules: []\n")
    # Not a test of health checks: a probe slowed by a loaded machine must not eject a fake mid-run.
    text = text.replace("eject_after_failures: 2", "eject_after_failures: 1000")
    all_hq, all_fast = tmp_path / "all-hq.yaml", tmp_path / "all-fast.yaml"
    all_hq.write_text(text.replace("default: fast", "default: hq"))
    all_fast.write_text(text)
    cases = tmp_path / "cases.yaml"
    cases.write_text(CASES)
    return cases, all_hq, all_fast


async def test_two_policies_side_by_side_with_intervals_on_the_difference(
    pair_files: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    cases, all_hq, all_fast = pair_files
    runs = tmp_path / "runs.jsonl"
    args = ["eval", "--cases", str(cases), "--policy", str(all_hq), "--policy", str(all_fast), "--out", str(runs)]
    assert await asyncio.to_thread(main, args) == 0
    out = capsys.readouterr().out
    assert out.startswith("10 cases x 1 under 2 policies (20 agent runs; outcomes recorded: 20)")
    rows = {line[:24].strip(): line[24:].split() for line in out.splitlines() if line[:24].strip()}
    assert rows["pass rate"] == ["100.0%", "50.0%"]
    assert rows["pass rate [hard]"] == ["100.0%", "of", "5", "0.0%", "of", "5"]
    assert rows["pass rate [easy]"] == ["100.0%", "of", "5", "100.0%", "of", "5"]
    assert rows["mean steps"] == ["1.5", "1.5"]  # hard cases take two steps: the call, then the answer
    diff = next(line for line in out.splitlines() if line.startswith("all-fast vs all-hq"))
    assert "pass rate -50.0 pts (95% CI [" in diff and "cost per solved case x" in diff
    results = [json.loads(line) for line in runs.read_text().splitlines()]
    assert all(r["outcome_recorded"] and r["cost_usd"] > 0 for r in results)
    assert {r["reason"] for r in results if not r["passed"]} == {"the answer lacks '5781': 'The answer is about 5000.'"}

    assert await asyncio.to_thread(main, [*args[:-2], "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    low, high = figures["differences"]["all-fast"]["pass_rate_interval"]
    assert low < -0.5 < high < 0  # fast's drop on hard cases is real at this size
    hq, fast = figures["summaries"]["all-hq"], figures["summaries"]["all-fast"]
    assert fast["cost_per_solved_usd"] == pytest.approx(sum(
        r["cost_usd"] for r in results if r["policy"] == "all-fast") / 5)
    ratio = figures["differences"]["all-fast"]["cost_per_solved_ratio"]
    assert ratio == pytest.approx(fast["cost_per_solved_usd"] / hq["cost_per_solved_usd"])
    lo, hi = figures["differences"]["all-fast"]["cost_per_solved_interval"]
    assert lo <= ratio <= hi


async def test_against_a_running_gateway_each_policy_is_a_route_and_outcomes_are_recorded(
    make_stack: Callable[..., Any], pair_files: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    cases, _, _ = pair_files
    stack: Stack = await make_stack()
    base = str(stack.gateway.make_url("")).rstrip("/")
    code = await asyncio.to_thread(main, ["eval", "--cases", str(cases), "--url", base, "--policy", "hq",
                                          "--policy", "fast", "--repeat", "2"])
    assert code == 0
    out = capsys.readouterr().out
    assert "(40 agent runs; outcomes recorded: 40)" in out
    _, listed = await admin(base, "/admin/sessions?limit=100")
    outcomes = [s["outcome"] for s in listed["data"]]
    assert len(outcomes) == 40 and all(o is not None for o in outcomes)
    assert {o["labels"]["policy"] for o in outcomes} == {"hq", "fast"}
    hard_on_fast = [s for s in listed["data"] if s["deployments"] == {"fast": 2}]
    assert len(hard_on_fast) == 10 and not any(s["outcome"]["success"] for s in hard_on_fast)
    _, figures = await admin(base, "/admin/outcomes")
    by_mix = {r["mix"]: r for r in figures["data"]}
    assert by_mix["hq"]["success_rate"] == 1.0 and by_mix["fast"]["success_rate"] == 0.5


async def test_a_bad_case_file_is_one_line_naming_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("cases:\n  - id: a\n    prompt: x\n    expect: {tool_called: [nope]}\n")
    assert await asyncio.to_thread(main, ["eval", "--cases", str(bad), "--url", "http://127.0.0.1:9",
                                          "--policy", "auto"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {bad}: cases.0: ") and "'nope'" in err and len(err.splitlines()) == 1


def test_the_shipped_examples_load_and_their_checks_judge() -> None:
    cases = {c.id: c for c in load(str(EXAMPLES))}
    assert len(cases) >= 5 and {"easy", "hard", "tools"} <= {t for c in cases.values() for t in c.tags}
    bug: Case = cases["find-the-bug"]
    assert check(bug, Run("Line 4 overwrites the sum.", [("read_file", {"path": "cart.py"})])) == (True, "passed")
    assert check(bug, Run("Line 4 is wrong.", []))[1] == 'no call of read_file with {"path": "cart.py"}'
    assert check(bug, Run(None, [("read_file", {"path": "cart.py"})]))[1] == "no final answer within 4 steps"
    assert not check(cases["capital-france"], Run("Paris", [("x", {})]))[0]


LOG = "\n".join(f"tests/test_mod{j}.py::test_case PASSED ({j} of 300)" for j in range(300))
LONG_CASES = "cases:\n" + "".join(f"""
  - id: long-{i}
    prompt: "Run the suite until it passes ({i})."
    max_steps: 6
    tools:
      - name: shell
        parameters: {{type: object, properties: {{cmd: {{type: string}}}}}}
        result: {json.dumps(LOG)}
    expect: {{tool_called: [shell], answer_contains: ["passes"]}}
""" for i in range(4))


def looping(fake: FakeVLLM) -> None:
    """An agent's loop: the shell called four times (each output a long test log), then the answer."""

    def message(body: dict[str, Any]) -> dict[str, Any]:
        outputs = [m for m in body["messages"] if m["role"] == "tool"]
        if len(outputs) < 4:
            call = {"id": f"call_{len(outputs)}", "type": "function",
                    "function": {"name": "shell", "arguments": json.dumps({"cmd": "pytest"})}}
            return {"role": "assistant", "content": None, "tool_calls": [call]}
        return {"role": "assistant", "content": "The suite passes."}

    fake.message = message
    fake.prompt_tokens = lambda body: len(json.dumps(body["messages"])) // 4  # the prompt's size, roughly


async def test_a_policy_with_context_rules_against_one_without_on_the_same_cases(
    fake_pair: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`eval --policy A --policy B` compares context rules like any policy change: the same cases solved, at a
    lower cost per solved case where old tool outputs are masked (each step re-sends fewer tokens)."""
    hq, hq_server, fast, fast_server = fake_pair
    looping(hq)
    looping(fast)
    text = policy_yaml(str(hq_server.make_url("")).rstrip("/"), str(fast_server.make_url("")).rstrip("/"),
                       rules="rules: []\n").replace("eject_after_failures: 2", "eject_after_failures: 1000")
    whole, masked = tmp_path / "whole.yaml", tmp_path / "masked.yaml"
    whole.write_text(text)
    masked.write_text(text + "context:\n  mask_tool_outputs: {keep_last: 1, over_tokens: 200, batch_tokens: 0}\n"
                      f"store:\n  objects: {{path: {tmp_path / 'objects'}}}\n")
    cases = tmp_path / "cases.yaml"
    cases.write_text(LONG_CASES)
    args = ["eval", "--cases", str(cases), "--policy", str(whole), "--policy", str(masked), "--json"]
    assert await asyncio.to_thread(main, args) == 0
    figures = json.loads(capsys.readouterr().out)
    plain, managed = figures["summaries"]["whole"], figures["summaries"]["masked"]
    assert plain["pass_rate"] == managed["pass_rate"] == 1.0
    assert managed["cost_per_solved_usd"] < 0.8 * plain["cost_per_solved_usd"]
    assert figures["differences"]["masked"]["cost_per_solved_ratio"] < 0.8
    # each masked run's later steps reached the deployment with stubs in place of the older logs
    assert any("masked by the gateway" in json.dumps(body) for body in fast.received)
