"""Old tool outputs masked by the policy's rule: the newest K kept, the size threshold, the stub (reference, size,
exit code, head and tail), stickiness (the next step's prompt starts with this one's, byte for byte, until the
frontier jumps), the frontier moving only in batches, outputs replaced whole or not at all, in all three APIs."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from gateway.context import tool_outputs
from gateway.context.masking import MaskRule, ToolOutput, frontier, mask, read_stub, stub_of
from gateway.context.tool_outputs import masked_body


def words(text: str) -> int:
    """A count a reader can check by eye: one token a word."""
    return len(text.split())


def output(n_words: int, tag: str = "x") -> ToolOutput:
    return ToolOutput(" ".join(f"{tag}{i}" for i in range(n_words)))


def rule(keep_last: int = 3, over_tokens: int = 0, batch_tokens: int = 0, head: int = 20, tail: int = 20) -> MaskRule:
    return MaskRule(keep_last, over_tokens, batch_tokens, head, tail)


def masked_indices(outputs: list[ToolOutput], r: MaskRule) -> list[int]:
    return [m.index for m in mask(outputs, r, words).masked]


@pytest.mark.parametrize(("keep_last", "masked"), [
    (0, [0, 1, 2, 3, 4, 5]),
    (1, [0, 1, 2, 3, 4]),
    (3, [0, 1, 2]),
    (6, []),
    (9, []),
])
def test_the_newest_keep_last_outputs_are_never_masked(keep_last: int, masked: list[int]) -> None:
    outputs = [output(100, f"o{i}-") for i in range(6)]
    assert masked_indices(outputs, rule(keep_last=keep_last)) == masked


@pytest.mark.parametrize(("over_tokens", "masked"), [
    (0, [0, 1, 2, 3]),
    (60, [1, 3]),  # only outputs over the threshold
    (200, [3]),
    (500, []),
])
def test_only_outputs_over_the_size_threshold_are_masked(over_tokens: int, masked: list[int]) -> None:
    sizes = [50, 100, 45, 300, 400, 400, 400]  # the last three are kept whatever their size
    outputs = [output(n, f"o{i}-") for i, n in enumerate(sizes)]
    assert masked_indices(outputs, rule(over_tokens=over_tokens)) == masked


def test_an_output_no_longer_than_its_stub_is_left_as_it_is() -> None:
    outputs = [ToolOutput("ok"), ToolOutput("done\n" * 3), output(200), output(1), output(1), output(1)]
    assert masked_indices(outputs, rule()) == [2]


CODEX_FAILURE = "Exit code: 2\nWall time: 0.4 seconds\nOutput:\n" + "".join(
    f"tests/test_{i}.py::test_case FAILED\n" for i in range(200)) + "=== 200 failed in 3.2s ==="


@pytest.mark.parametrize(("text", "is_error", "exit_code"), [
    (CODEX_FAILURE, None, "exit code 2"),
    ("Exit code 1\n" + "line of output\n" * 300, None, "exit code 1"),  # Claude Code's header
    ("line of output\n" * 300 + "[Command finished with exit code 137]", None, "exit code 137"),
    ("line of output\n" * 300, True, None),  # Anthropic's is_error says it failed, but names no exit code
    ("line of output\n" * 300, None, None),
])
def test_a_stub_names_the_reference_size_tokens_exit_code_head_and_tail(
    text: str, is_error: bool | None, exit_code: str | None
) -> None:
    stub = stub_of(text, is_error, 120, 80, words)
    data = text.encode()
    first, *rest = stub.text.split("\n")
    assert stub.ref == "ctx_" + hashlib.sha256(data).hexdigest()
    assert f"{len(data)} bytes, {words(text)} tokens" in first
    assert f"GET /v1/context/{stub.ref}" in first
    assert (exit_code in first) if exit_code else ("exit code" not in first)
    shown = "\n".join(rest)
    head, _, tail = shown.partition("\n[... ")
    assert text.startswith(head) and 60 <= len(head) <= 120  # cut at a line's end in the second half
    assert text.endswith(tail.split(" bytes not shown ...]\n", 1)[1])
    hidden = int(tail.split(" bytes")[0])
    assert hidden == len(data) - len(head.encode()) - len(tail.split("not shown ...]\n", 1)[1].encode())
    assert read_stub(stub.text) == (stub.ref, words(text))
    assert stub_of(text, is_error, 120, 80, words) == stub  # a function of the original alone


def test_the_frontier_moves_only_in_batches() -> None:
    savings = [100] * 20
    # keep 3, batch 450: the frontier waits until 5 newly old outputs (500 tokens) can go at once
    steps = [frontier(savings[:n], 3, 450) for n in range(1, 21)]
    assert steps == [0] * 7 + [5] * 5 + [10] * 5 + [15] * 3
    assert frontier(savings, 3, 0) == 17  # batch 0: every step (the cache-hostile way)
    assert frontier([0, 0, 0, 500, 0, 0, 0], 3, 450) == 4  # nothing worth masking does not hold it back
    assert frontier([0] * 10, 3, 0) == 0


def chat_session(steps: int, sizes: list[int]) -> list[list[dict[str, Any]]]:
    """Each step's messages of a chat agent: the ask, then per step a tool call and its output."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You fix builds."},
                                      {"role": "user", "content": "Why does the build fail?"}]
    bodies = []
    for i in range(steps):
        args = json.dumps({"cmd": f"cat build/{i}.log", "filter": {"level": "error", "n": i}})
        log = "\n".join(f"log {i} line {j}: error at step {j}" for j in range(sizes[i % len(sizes)]))
        messages = [*messages,
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": f"call_{i}", "type": "function", "function": {"name": "shell", "arguments": args}}]},
                    {"role": "tool", "tool_call_id": f"call_{i}",
                     "content": log}]
        bodies.append(messages)
    return bodies


def test_a_masked_prompt_is_sticky_and_the_frontier_moves_in_batches() -> None:
    """Step n+1's prompt starts with step n's, byte for byte, whenever the frontier did not move; it moves
    rarely, and each move saves at least batch_tokens."""
    r = rule(keep_last=3, over_tokens=50, batch_tokens=1500, head=200, tail=200)
    steps = chat_session(30, [40, 10, 60, 30])
    sent, frontiers = [], []
    for messages in steps:
        body, masking = masked_body(tool_outputs.CHAT, {"model": "auto", "messages": messages}, r, words)
        sent.append(json.dumps(body["messages"], separators=(",", ":")))
        frontiers.append(masking.frontier)
        if masking.masked:
            assert masking.tokens_saved >= r.batch_tokens
    moves = [n for n in range(1, len(steps)) if frontiers[n] != frontiers[n - 1]]
    assert 2 <= len(moves) <= 6  # not every step: 30 steps, a handful of jumps
    for n in range(1, len(steps)):
        if n not in moves:
            assert sent[n].startswith(sent[n - 1][:-1])  # the same list's bytes, then the new messages
    assert frontiers == sorted(frontiers)  # never back


def test_outputs_are_replaced_whole_or_left_byte_for_byte() -> None:
    """Code and JSON are never cut: a tool output is its original or a stub; tool calls are never touched."""
    document = json.dumps({"files": [{"path": f"src/m{i}.py", "code": f"def f{i}():\n    return {i}\n"}
                                     for i in range(80)]}, indent=2)
    code = "".join(f"def handler_{i}(request):\n    return respond(request, {i})\n\n" for i in range(80))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "refactor"}]
    for i, text in enumerate([document, code, document + " ", code + "#", "short", "tiny"]):
        messages += [{"role": "assistant", "tool_calls": [{"id": f"c{i}", "type": "function",
                                                           "function": {"name": "read", "arguments": document}}]},
                     {"role": "tool", "tool_call_id": f"c{i}", "content": text}]
    body, masking = masked_body(tool_outputs.CHAT, {"messages": messages}, rule(keep_last=2), words)
    assert [m.index for m in masking.masked] == [0, 1, 2, 3]
    for before, after in zip(messages, body["messages"], strict=True):
        if before["role"] != "tool":
            assert after == before
        elif after["content"] != before["content"]:
            assert read_stub(after["content"]) is not None
            assert after == {**before, "content": after["content"]}


def test_what_is_masked_stays_masked_the_same_way_when_sent_back() -> None:
    """A client (or the Responses API's stored conversation) that sends stubs back gets the same prompt: a stub
    is never masked again, and counts as its original did, so the frontier stays where it was."""
    r = rule(keep_last=2, over_tokens=50, batch_tokens=300)
    [*_, messages] = chat_session(12, [120])
    once, first = masked_body(tool_outputs.CHAT, {"messages": messages}, r, words)
    twice, second = masked_body(tool_outputs.CHAT, once, r, words)
    assert twice == once
    assert second.frontier == first.frontier and second.tokens_saved == first.tokens_saved
    assert second.fresh == ()  # nothing new to store


def test_an_output_that_is_not_text_alone_is_never_masked() -> None:
    image = [{"type": "text", "text": "word " * 500}, {"type": "image", "source": {"type": "base64", "data": "AA"}}]
    body = {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}",
                                                       "content": image}]} for i in range(5)]}
    changed, masking = masked_body(tool_outputs.MESSAGES, body, rule(keep_last=1), words)
    assert changed is body and masking.masked == ()


LOG = "\n".join(f"error: line {j} of the build log" for j in range(60))


def three_apis(n: int) -> dict[str, tuple[tool_outputs.ToolOutputs, dict[str, Any]]]:
    """One agent's n tool calls and outputs, as each API carries them."""
    chat: list[Any] = [{"role": "user", "content": "fix it"}]
    responses: list[Any] = [{"role": "user", "content": "fix it"}]
    messages: list[Any] = [{"role": "user", "content": "fix it"}]
    for i in range(n):
        text = f"run {i}\n{LOG}"
        chat += [{"role": "assistant", "tool_calls": [{"id": f"c{i}", "type": "function",
                                                       "function": {"name": "sh", "arguments": "{}"}}]},
                 {"role": "tool", "tool_call_id": f"c{i}", "content": [{"type": "text", "text": text}]}]
        responses += [{"type": "function_call", "call_id": f"c{i}", "name": "sh", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": f"c{i}", "output": text}]
        messages += [{"role": "assistant", "content": [{"type": "tool_use", "id": f"c{i}", "name": "sh",
                                                        "input": {}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"c{i}", "is_error": i == 0,
                                                   "content": text, "cache_control": {"type": "ephemeral"}}]}]
    return {"chat": (tool_outputs.CHAT, {"messages": chat}),
            "responses": (tool_outputs.RESPONSES, {"input": responses}),
            "messages": (tool_outputs.MESSAGES, {"messages": messages})}


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_every_api_masks_the_same_outputs_with_the_same_stubs(api: str) -> None:
    shape, body = three_apis(6)[api]
    changed, masking = masked_body(shape, body, rule(keep_last=2), words)
    assert [m.index for m in masking.masked] == [0, 1, 2, 3]
    chat_masking = masked_body(*three_apis(6)["chat"], rule(keep_last=2), words)[1]
    assert [m.stub for m in masking.masked][1:] == [m.stub for m in chat_masking.masked][1:]
    found = shape.find(changed)
    assert [read_stub(o.text or "") is not None for _, o in found] == [True] * 4 + [False] * 2
    if api == "messages":  # every other field of the block stays: its id, is_error, cache_control
        block = changed["messages"][2]["content"][0]
        assert block["tool_use_id"] == "c0" and block["is_error"] is True and block["cache_control"]
    if api == "responses":
        assert changed["input"][2]["call_id"] == "c0" and changed["input"][2]["type"] == "function_call_output"
    assert body == three_apis(6)[api][1]  # the client's body is never changed in place
