"""Anthropic's context edits as the gateway makes them: the edits read from the request (defaults, 400s that name
field and value), tool results and thinking cleared by Anthropic's rules, compaction blocks taken in."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.context.anthropic_config import ClearThinking, ClearToolUses, read_edits
from gateway.context.anthropic_edits import CLEARED_TOOL_RESULT, clear_thinking, clear_tool_uses, manage
from gateway.errors import BadRequest


def words(text: str) -> int:
    """A count whose figures a reader can check by eye: one token a word."""
    return len(text.split())


PLACEHOLDER = words(CLEARED_TOOL_RESULT)
RESULT = "word " * 50  # each tool result: 50 tokens


def agent_loop(tools: list[str], result: str = RESULT, thinking: bool = False) -> list[dict[str, Any]]:
    """An agent's conversation: the ask, then per tool a tool_use turn and its result, oldest first."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "fix the build"}]
    for i, name in enumerate(tools):
        turn: list[dict[str, Any]] = [{"type": "thinking", "thinking": f"step {i} needs {name}", "signature": "s"}] \
            if thinking else []
        turn.append({"type": "tool_use", "id": f"toolu_{i}", "name": name, "input": {"path": f"/src/f{i}.py"}})
        messages += [{"role": "assistant", "content": turn},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}",
                                                   "content": result}]}]
    return messages


def tool_edit(trigger: int = 0, keep: int = 3, at_least: int = 0, exclude: frozenset[str] = frozenset(),
              inputs: bool | frozenset[str] = False, trigger_type: str = "input_tokens") -> ClearToolUses:
    return ClearToolUses(trigger_type, trigger, keep, at_least, exclude, inputs)


def cleared_ids(messages: list[dict[str, Any]]) -> list[str]:
    return [b["tool_use_id"] for m in messages if isinstance(m["content"], list) for b in m["content"]
            if b.get("type") == "tool_result" and b["content"] == CLEARED_TOOL_RESULT]


@pytest.mark.parametrize(("edit", "prompt_tokens", "cleared", "freed"), [
    # trigger: the prompt must exceed it (input tokens, or the tool uses in the conversation)
    (tool_edit(trigger=1000), 1000, [], None),
    (tool_edit(trigger=1000), 1001, ["toolu_0", "toolu_1"], 2 * (50 - PLACEHOLDER)),
    (tool_edit(trigger=5, trigger_type="tool_uses"), 0, [], None),
    (tool_edit(trigger=4, trigger_type="tool_uses"), 0, ["toolu_0", "toolu_1"], 2 * (50 - PLACEHOLDER)),
    # keep: the newest N tool uses stay; 0 keeps none
    (tool_edit(keep=1), 10, ["toolu_0", "toolu_1", "toolu_2", "toolu_3"], 4 * (50 - PLACEHOLDER)),
    (tool_edit(keep=0), 10, ["toolu_0", "toolu_1", "toolu_2", "toolu_3", "toolu_4"], 5 * (50 - PLACEHOLDER)),
    (tool_edit(keep=5), 10, [], None),
    # clear_at_least: all or nothing
    (tool_edit(at_least=2 * (50 - PLACEHOLDER)), 10, ["toolu_0", "toolu_1"], 2 * (50 - PLACEHOLDER)),
    (tool_edit(at_least=2 * (50 - PLACEHOLDER) + 1), 10, [], None),
    # exclude_tools: never cleared, and still counted among the newest kept
    (tool_edit(keep=1, exclude=frozenset({"Read"})), 10, ["toolu_1", "toolu_3"], 2 * (50 - PLACEHOLDER)),
])
def test_tool_results_are_cleared_oldest_first_past_the_trigger(
    edit: ClearToolUses, prompt_tokens: int, cleared: list[str], freed: int | None
) -> None:
    messages = agent_loop(["Read", "Bash", "Read", "Bash", "Read"])
    out, applied = clear_tool_uses(messages, edit, prompt_tokens, words)
    assert cleared_ids(out) == cleared
    if freed is None:
        assert applied is None and out is messages
    else:
        assert applied is not None
        assert applied.as_anthropic() == {"type": "clear_tool_uses_20250919", "cleared_tool_uses": len(cleared),
                                          "cleared_input_tokens": freed}
    assert cleared_ids(messages) == []  # the client's history is never changed in place


@pytest.mark.parametrize(("inputs", "emptied"), [
    (False, []), (True, ["toolu_0", "toolu_1"]), (frozenset({"Bash"}), ["toolu_1"]),
])
def test_clear_tool_inputs_empties_the_inputs_of_the_cleared_uses(
    inputs: bool | frozenset[str], emptied: list[str]
) -> None:
    messages = agent_loop(["Read", "Bash", "Read", "Bash", "Read"])
    out, applied = clear_tool_uses(messages, tool_edit(inputs=inputs), 10, words)
    uses = [b for m in out if m["role"] == "assistant" for b in m["content"] if b["type"] == "tool_use"]
    assert [u["id"] for u in uses if u["input"] == {}] == emptied
    assert applied is not None and applied.cleared == 2
    input_tokens = words('{"path":"/src/f0.py"}') - words("{}")
    assert applied.cleared_input_tokens == 2 * (50 - PLACEHOLDER) + len(emptied) * input_tokens


@pytest.mark.parametrize(("keep", "kept_turns", "cleared_turns"), [
    (1, [4], 4), (2, [3, 4], 3), (5, [0, 1, 2, 3, 4], 0), (None, [0, 1, 2, 3, 4], 0), (0, [], 5),
])
def test_thinking_is_kept_for_the_newest_turns_only(
    keep: int | None, kept_turns: list[int], cleared_turns: int
) -> None:
    messages = agent_loop(["Read", "Bash", "Read", "Bash", "Read"], thinking=True)
    out, applied = clear_thinking(messages, ClearThinking(keep), words)
    turns = [m for m in out if m["role"] == "assistant"]
    assert [i for i, m in enumerate(turns) if m["content"][0]["type"] == "thinking"] == kept_turns
    assert all(m["content"][-1]["type"] == "tool_use" for m in turns)  # only the thinking goes
    if cleared_turns:
        assert applied is not None and applied.as_anthropic() == {
            "type": "clear_thinking_20251015", "cleared_thinking_turns": cleared_turns,
            "cleared_input_tokens": cleared_turns * 4}  # "step i needs Tool"
    else:
        assert applied is None


def test_edits_apply_in_order_and_the_field_never_reaches_the_deployment() -> None:
    body = {"model": "m", "max_tokens": 9, "messages": agent_loop(["Read"] * 5, thinking=True),
            "context_management": {"edits": [
                {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}},
                {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 100},
                 "keep": {"type": "tool_uses", "value": 2}}]}}
    managed = manage(body, read_edits(body), words)
    assert "context_management" not in managed.body and "context_management" in body
    assert managed.reported_edits() == [
        {"type": "clear_thinking_20251015", "cleared_thinking_turns": 4, "cleared_input_tokens": 16},
        {"type": "clear_tool_uses_20250919", "cleared_tool_uses": 3, "cleared_input_tokens": 3 * (50 - PLACEHOLDER)}]
    assert managed.tokens_before - managed.tokens_after == 16 + 3 * (50 - PLACEHOLDER)
    assert cleared_ids(managed.body["messages"]) == ["toolu_0", "toolu_1", "toolu_2"]


def test_the_same_history_is_edited_the_same_way_each_turn() -> None:
    """The deployment's prefix cache survives from one turn to the next when nothing new is cleared."""
    body = {"model": "m", "max_tokens": 9, "messages": agent_loop(["Read"] * 6),
            "context_management": {"edits": [{"type": "clear_tool_uses_20250919",
                                              "trigger": {"type": "input_tokens", "value": 10}}]}}
    assert manage(body, read_edits(body)).body == manage(body, read_edits(body)).body


def test_defaults_are_anthropics() -> None:
    edits = read_edits({"context_management": {"edits": [
        {"type": "clear_thinking_20251015"}, {"type": "clear_tool_uses_20250919"}, {"type": "compact_20260112"}]}})
    assert [(e.type, e) for e in edits] == [
        ("clear_thinking_20251015", ClearThinking(1)),
        ("clear_tool_uses_20250919", ClearToolUses("input_tokens", 100_000, 3, 0, frozenset(), False)),
        ("compact_20260112", edits[2])]
    assert (edits[2].trigger, edits[2].instructions, edits[2].pause_after) == (150_000, None, False)


@pytest.mark.parametrize("keep", ["all", {"type": "all"}])
def test_claude_codes_keep_all_thinking_is_read(keep: Any) -> None:
    assert read_edits({"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": keep}]}}) == (
        ClearThinking(None),)


@pytest.mark.parametrize(("edits", "param", "shown"), [
    ([{"type": "clear_everything"}], "context_management.edits[0].type", "'clear_everything'"),
    ([{"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses", "value": -1}}],
     "context_management.edits[0].keep.value", "-1"),
    ([{"type": "clear_tool_uses_20250919", "keep": {"type": "thinking_turns", "value": 2}}],
     "context_management.edits[0].keep.type", "'thinking_turns'"),
    ([{"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": "100"}}],
     "context_management.edits[0].trigger.value", "'100'"),
    ([{"type": "clear_tool_uses_20250919", "exclude_tools": "Read"}],
     "context_management.edits[0].exclude_tools", "'Read'"),
    ([{"type": "clear_tool_uses_20250919", "clear_tool_inputs": "yes"}],
     "context_management.edits[0].clear_tool_inputs", "'yes'"),
    ([{"type": "clear_tool_uses_20250919", "keep_last": 3}], "context_management.edits[0].keep_last", "3"),
    ([{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1.5}}],
     "context_management.edits[0].keep.value", "1.5"),
    ([{"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 20_000}}],
     "context_management.edits[0].trigger.value", "20000"),
    ([{"type": "compact_20260112", "pause_after_compaction": "no"}],
     "context_management.edits[0].pause_after_compaction", "'no'"),
    ([{"type": "clear_tool_uses_20250919"}, {"type": "clear_thinking_20251015"}],
     "context_management.edits[1].type", "'clear_thinking_20251015'"),
    ([{"type": "clear_tool_uses_20250919"}, {"type": "clear_tool_uses_20250919"}],
     "context_management.edits[1].type", "'clear_tool_uses_20250919'"),
    ("all", "context_management.edits", "'all'"),
])
def test_a_bad_edit_is_a_400_naming_its_field_and_value(edits: Any, param: str, shown: str) -> None:
    with pytest.raises(BadRequest) as caught:
        read_edits({"context_management": {"edits": edits}})
    assert caught.value.param == param
    assert caught.value.message.startswith(f"{param}: {shown} ")


def test_a_compaction_sent_back_replaces_what_came_before_it() -> None:
    earlier = agent_loop(["Read", "Bash"])
    messages = [*earlier, {"role": "assistant", "content": [{"type": "compaction", "content": "SUMMARY"},
                                                            {"type": "text", "text": "Going on."}]},
                {"role": "user", "content": "and now the tests"}]
    body = {"model": "m", "max_tokens": 9, "messages": messages,
            "context_management": {"edits": [{"type": "compact_20260112"}]}}
    managed = manage(body, read_edits(body), words)
    assert managed.took_in_summary and managed.compaction is None
    out = managed.body["messages"]
    assert [m["role"] for m in out] == ["user", "assistant", "user"]
    assert out[0]["content"][0]["text"].endswith("SUMMARY")
    assert out[1]["content"] == [{"type": "text", "text": "Going on."}]


def test_a_compaction_is_due_past_its_trigger() -> None:
    big = "word " * 50_001
    body = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": big}],
            "context_management": {"edits": [{"type": "compact_20260112",
                                              "trigger": {"type": "input_tokens", "value": 50_000}}]}}
    assert manage(body, read_edits(body), words).compaction is not None
    body["messages"] = [{"role": "user", "content": "word " * 50_000}]
    assert manage(body, read_edits(body), words).compaction is None
