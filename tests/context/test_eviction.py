"""Old turns summarized (gateway/context/eviction.py): where the span ends, worked out by hand; it is sticky from
one step to the next and moves in large steps; no turn is split between a call and its result; each API's body
gets the summary in the span's place and keeps everything else."""

from __future__ import annotations

import json
from typing import Any

from gateway.context.eviction import (
    CHAT,
    MESSAGES,
    RESPONSES,
    EvictRule,
    Turns,
    boundary,
    read_turns,
    span_document,
    summarized,
)

RULE = EvictRule(over_tokens=1_000, keep_tokens=300, summary_tokens=100)


def turns(tokens: list[int], starts: list[bool], head: int = 1) -> Turns:
    return Turns(head, tuple(tokens), tuple(starts), (), ())


def test_nothing_is_summarized_while_what_follows_the_head_fits() -> None:
    # the head (5,000 tokens: a long system prompt) is not counted; 4 x 250 = 1,000 is not over 1,000
    assert boundary(turns([5_000, 250, 250, 250, 250], [False, True, False, True, False]), RULE) == 1


def test_the_span_ends_where_at_most_keep_tokens_of_the_newest_turns_remain() -> None:
    # entries 1..6: a(100) t(400) a(100) t(400) a(100) t(150): over 1,000 at entry 6 (1,250);
    # kept from entry 5 (a, 250 tokens <= 300); from entry 3 it would be 750 > 300
    tokens = [50, 100, 400, 100, 400, 100, 150]
    starts = [False, True, False, True, False, True, False]
    assert boundary(turns(tokens, starts), RULE) == 5


def test_at_least_the_newest_turn_is_kept_even_over_keep_tokens() -> None:
    tokens = [50, 100, 600, 100, 900]  # the newest turn alone is 1,000 > 300: it stays whole
    starts = [False, True, False, True, False]
    assert boundary(turns(tokens, starts), RULE) == 3


def test_the_span_is_sticky_and_moves_only_when_the_rest_outgrows_the_rule_again() -> None:
    tokens = [50, 100, 400, 100, 400, 100, 150]
    starts = [False, True, False, True, False, True, False]
    cut = boundary(turns(tokens, starts), RULE)
    # each next step re-sends the same entries plus one turn of 150: the summary (100) and the kept part grow
    grown_tokens, grown_starts, cuts = list(tokens), list(starts), []
    for _ in range(8):
        grown_tokens += [50, 100]
        grown_starts += [True, False]
        cuts.append(boundary(turns(grown_tokens, grown_starts), RULE))
    assert cuts[0] == cut  # 100 + 250 + 150 = 500: the same span, the same summary
    assert cuts == sorted(cuts)  # never back
    moves = [b for a, b in zip([cut, *cuts], cuts, strict=False) if b != a]
    assert len(moves) == 1  # 100 + 250 + 8 x 150 = 1,550 passes 1,000 once in eight steps


def _chat() -> dict[str, Any]:
    messages: list[Any] = [{"role": "system", "content": "You are a coding agent."},
                           {"role": "user", "content": "Fix the parser."}]
    for i in range(6):
        messages += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "sh", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": f"output {i} " + "x " * 400}]
    return {"model": "auto", "messages": messages, "tools": [{"type": "function", "function": {"name": "sh"}}]}


def test_chat_turns_start_at_assistant_messages_and_the_summary_takes_the_span_s_place() -> None:
    body = _chat()
    found = read_turns(CHAT, body)
    assert found is not None
    assert found.head == 2  # the system prompt and the task
    assert found.starts == tuple(m["role"] in ("user", "assistant") for m in body["messages"])
    cut = boundary(found, EvictRule(over_tokens=1_500, keep_tokens=900, summary_tokens=100))
    assert found.starts[cut] and body["messages"][cut]["role"] == "assistant"
    out = summarized(CHAT, body, found.head, cut, "SUMMARY")
    assert out["messages"] == [*body["messages"][:2], {"role": "user", "content": "SUMMARY"},
                               *body["messages"][cut:]]
    assert out["tools"] == body["tools"] and body["messages"][2]["role"] == "assistant"  # the body is not changed
    assert json.loads(span_document(found, cut)) == body["messages"][2:cut]


def test_digests_name_the_same_span_at_the_next_step_and_differ_for_another_conversation() -> None:
    body = _chat()
    first = read_turns(CHAT, body)
    later = read_turns(CHAT, {**body, "messages": [*body["messages"], {"role": "assistant", "content": "done"}]})
    other = read_turns(CHAT, {**body, "messages": [{"role": "system", "content": "another agent"},
                                                   *body["messages"][1:]]})
    assert first is not None and later is not None and other is not None
    assert later.digests[:len(first.digests)] == first.digests
    assert all(a != b for a, b in zip(first.digests, other.digests, strict=True))


def test_responses_turns_never_split_a_call_from_its_output() -> None:
    items = [{"role": "user", "content": "task"},
             {"type": "reasoning", "summary": []},
             {"type": "function_call", "call_id": "a", "name": "sh", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "a", "output": "ok"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "next"}]},
             {"type": "function_call", "call_id": "b", "name": "sh", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "b", "output": "ok"}]
    found = read_turns(RESPONSES, {"input": items})
    assert found is not None and found.head == 1
    assert found.starts == (True, True, False, False, True, True, False)
    out = summarized(RESPONSES, {"input": items}, 1, 4, "S")
    assert out["input"][1] == {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "S"}]}
    assert out["input"][2:] == items[4:]


def test_messages_turns_start_at_assistant_messages_and_the_summary_is_a_user_text_block() -> None:
    history = [{"role": "user", "content": "task"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "sh", "input": {}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]},
               {"role": "assistant", "content": [{"type": "text", "text": "done"}]}]
    found = read_turns(MESSAGES, {"messages": history, "system": "be brief"})
    assert found is not None and found.head == 1 and found.starts == (False, True, False, True)
    out = summarized(MESSAGES, {"messages": history, "system": "be brief"}, 1, 3, "S")
    assert out["messages"][1] == {"role": "user", "content": [{"type": "text", "text": "S"}]}
    assert out["system"] == "be brief" and out["messages"][2:] == history[3:]


def test_a_body_without_a_list_of_entries_has_no_turns() -> None:
    assert read_turns(RESPONSES, {"input": "just a string"}) is None
    assert read_turns(CHAT, {"messages": []}) is None


def test_an_entry_with_a_lone_surrogate_is_read_and_kept_as_sent() -> None:
    body = {"messages": [{"role": "user", "content": "task"}, {"role": "assistant", "content": "half \ud800 of it"}]}
    found = read_turns(CHAT, body)
    assert found is not None and found.tokens[1] > 0
    assert json.loads(span_document(found, 2).decode("utf-8", "surrogatepass")) == [body["messages"][1]]
