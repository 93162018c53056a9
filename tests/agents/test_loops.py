"""Dead loops over a session's recent steps, rework, and the verdict the request path acts on."""

from __future__ import annotations

import pytest

from gateway.agents.loops import (
    REPEATED_OUTPUT,
    REPEATED_TOOL_CALL,
    REPEATED_TOOL_ERROR,
    STEP_LIMIT,
    loops,
    rework,
    verdict,
)
from gateway.agents.trajectory import Step, ToolCall, ToolResult
from gateway.policy.agents import LoopPolicy, Repeats, SpikePolicy

RULES = LoopPolicy(repeated_tool_call=Repeats(count=3, window_steps=4), repeated_tool_error=Repeats(count=2,
                   window_steps=3), repeated_output=Repeats(count=3, window_steps=3), max_steps=50)


def _step(call: str | None = None, error: str | None = None, said: str = "") -> Step:
    calls = (ToolCall("search", call),) if call else ()
    results = (ToolResult("c", False, 3, error),) if error else (ToolResult("c", True, 3, "ok"),)
    return Step(0.0, "hq", "r", None, 1, 1, 0.0, 1.0, None, 200, calls, results, echo=said)


def _flags(history: list[Step], step: Step, total: int = 5) -> list[str]:
    return [f.flag for f in loops(history, step, RULES, total)]


@pytest.mark.parametrize(
    ("history", "step", "flags"),
    [
        ([_step("a"), _step("a")], _step("a"), [REPEATED_TOOL_CALL]),
        ([_step("a"), _step("b")], _step("a"), []),
        ([_step("a"), _step("x"), _step("x"), _step("a")], _step("a"), []),  # the first `a` left the window
        ([_step("a"), _step("a"), _step("a")], _step("b"), []),  # moved on: the flag lapses
        ([_step(error="E")], _step(error="E"), [REPEATED_TOOL_ERROR]),
        ([_step(error="E")], _step(error="F"), []),
        ([_step(said="s"), _step(said="s")], _step(said="s"), [REPEATED_OUTPUT]),
        ([_step(said=""), _step(said="")], _step(said=""), []),  # no text is no repetition
        ([_step("a", "E", "s"), _step("a", "E", "s")], _step("a", "E", "s"),
         [REPEATED_TOOL_CALL, REPEATED_TOOL_ERROR, REPEATED_OUTPUT]),
    ],
)
def test_loops(history: list[Step], step: Step, flags: list[str]) -> None:
    assert _flags(history, step) == flags


def test_a_loop_names_what_repeats() -> None:
    (finding,) = loops([_step("d1"), _step("d1")], _step("d1"), RULES, 3)
    assert finding.detail == "search(args d1) 3 times in the last 3 steps"


def test_too_many_steps_is_a_loop_too() -> None:
    assert _flags([], _step(), total=51) == [STEP_LIMIT]
    assert _flags([], _step(), total=50) == []


def test_rework_is_a_call_the_session_already_made() -> None:
    assert rework([_step("a"), _step("b")], _step("a"))
    assert not rework([_step("a")], _step("b")) and not rework([_step("a")], _step())


ACTING = LoopPolicy(action="escalate", escalate_to="hq")
STOPPING = SpikePolicy(action="stop")


def test_stop_wins_then_a_loop_escalates_then_a_spike_steers() -> None:
    active = {REPEATED_TOOL_CALL: (100.0, "loop"), "spike:session": (100.0, "spike")}
    found = verdict(active, ACTING, STOPPING, now=10.0)
    assert found is not None and (found.action, found.flag, found.code) == ("stop", "spike:session", "agent_cost_spike")
    assert found.retry_after_s == 90.0
    steer = verdict(active, ACTING, SpikePolicy(action="steer"), now=10.0)
    assert steer is not None and (steer.action, steer.target) == ("escalate", "hq")
    assert verdict(active, LoopPolicy(), SpikePolicy(), now=10.0) is None  # flag only
    assert verdict(active, ACTING, STOPPING, now=100.0) is None  # expired
    stopped = verdict({STEP_LIMIT: (100.0, "60 steps")}, LoopPolicy(action="stop"), SpikePolicy(), now=1.0)
    assert stopped is not None and stopped.code == "agent_loop_detected"
