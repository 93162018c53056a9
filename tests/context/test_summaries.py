"""The anchored summary: every answer read back into the six sections, in order; the transcript bounded."""

from __future__ import annotations

import pytest

from gateway.context.summaries import EMPTY, SECTIONS, read_summary, summary_prompt


@pytest.mark.parametrize(("text", "goal", "next_step"), [
    ("## Goal\nship it\n## Next step\nrun tests", "ship it", "run tests"),
    ("**Goal:**\nship it\n\n### next step\nrun tests", "ship it", "run tests"),  # any heading style
    ("Goal:\nship it\nNext step:\nrun tests", "ship it", "run tests"),
    ("just prose, no headings", "just prose, no headings", EMPTY),  # nothing it wrote is lost
    ("preamble\n## Goal\nship it", "preamble\nship it", EMPTY),
])
def test_any_answer_reads_back_as_the_six_sections(text: str, goal: str, next_step: str) -> None:
    summary = read_summary(text)
    assert summary.sections[0] == goal and summary.sections[-1] == next_step
    headings = [line for line in summary.text.splitlines() if line.startswith("## ")]
    assert headings == [f"## {name}" for name in SECTIONS]


def test_the_transcript_keeps_the_newest_entries_within_its_bound() -> None:
    messages = [{"role": "user", "content": f"message {i} " + "x" * 500} for i in range(100)]
    ask = summary_prompt(messages, max_chars=5_000)[1]["content"]
    assert "message 99" in ask and "message 0 " not in ask and "earlier entries left out" in ask
    assert len(ask) < 6_500


def test_tool_calls_and_long_outputs_are_in_the_transcript_cut_in_the_middle() -> None:
    messages = [{"role": "assistant", "content": "", "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "shell", "arguments": '{"cmd":"ls"}'}}]},
                {"role": "tool", "tool_call_id": "1", "content": "HEAD" + "y" * 10_000 + "TAIL"}]
    ask = summary_prompt(messages, max_chars=100_000)[1]["content"]
    assert 'calls shell({"cmd":"ls"})' in ask and "HEAD" in ask and "TAIL" in ask and "characters cut" in ask
