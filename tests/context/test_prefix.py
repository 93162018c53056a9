"""The prompt's hash chain: equal links mean equal prompts up to there; what a deployment holds of a new prompt."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench import agent_bodies
from gateway.apis import json_body
from gateway.apis.json_body import Source
from gateway.apis.recurring import Recurring
from gateway.context import prefix
from gateway.context.prefix import (
    EMPTY_CHAIN,
    NO_PREFIXES,
    Chain,
    after_serving,
    chain_of,
    common_tokens,
    decode,
    encode,
    rescaled,
)

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
SYSTEM = {"role": "system", "content": "You are a coding agent."}
TASK = {"role": "user", "content": "Fix the failing test in parser.py"}
CALL = {"role": "assistant", "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{\"c\":\"ls\"}"}}]}
RESULT = {"role": "tool", "tool_call_id": "c1", "content": "parser.py tests/"}
OTHER_CALL = {**CALL, "tool_calls": [{**CALL["tool_calls"][0], "function": {"name": "bash",
                                                                           "arguments": "{\"c\":\"pwd\"}"}}]}


def view(*messages: dict[str, Any], tools: list[Any] | None = TOOLS) -> dict[str, Any]:
    return {"messages": list(messages), **({"tools": tools} if tools else {})}


@pytest.mark.parametrize(("kept", "prompt", "shared_links"), [
    # the next step re-sends the last prompt and adds to it: every kept link holds
    ((SYSTEM, TASK), (SYSTEM, TASK, CALL, RESULT), 3),
    # the same prompt again: all of it
    ((SYSTEM, TASK, CALL, RESULT), (SYSTEM, TASK, CALL, RESULT), 5),
    # the agent rewrote its history (a compaction, a masked tool output): only what comes before the change
    ((SYSTEM, TASK, CALL, RESULT), (SYSTEM, TASK, OTHER_CALL, RESULT), 3),
    # another system prompt: nothing after the tools
    ((SYSTEM, TASK), ({"role": "system", "content": "You are terse."}, TASK), 1),
    # a later message equal to the kept one does not match once an earlier one differs (links hash their past)
    ((SYSTEM, TASK, CALL), ({"role": "system", "content": "other"}, TASK, CALL), 1),
])
def test_a_deployment_holds_the_prompt_up_to_where_the_chains_part(
        kept: tuple[dict[str, Any], ...], prompt: tuple[dict[str, Any], ...], shared_links: int) -> None:
    held = chain_of(view(*kept), 1000)
    wanted = chain_of(view(*prompt), 2000)
    assert common_tokens(held, wanted) == held[shared_links - 1].tokens
    assert [a.digest for a in held[:shared_links]] == [b.digest for b in wanted[:shared_links]]


@pytest.mark.parametrize(("kept", "prompt", "through"), [
    ("ab", "abcd", 2), ("abcd", "abcd", 4), ("abcd", "ab", 2), ("abcd", "abxd", 2), ("abc", "xbc", 0), ("", "ab", 0),
    ("ab", "", 0),
])
def test_the_tokens_held_are_those_through_the_last_link_both_chains_share(kept: str, prompt: str,
                                                                          through: int) -> None:
    """Whether the kept chain is all in the prompt (compared at once) or the two part somewhere (walked)."""
    def chain(links: str, each: int) -> Chain:
        return Chain.of((digest, each * (i + 1)) for i, digest in enumerate(links))

    assert common_tokens(chain(kept, 10), chain(prompt, 7)) == 10 * through


def test_other_tools_part_the_chains_at_once() -> None:
    assert common_tokens(chain_of(view(SYSTEM, TASK), 100), chain_of(view(SYSTEM, TASK, tools=None), 100)) == 0


@pytest.mark.parametrize(("messages", "tokens"), [((SYSTEM, TASK, CALL, RESULT), 4000), ((SYSTEM,), 37)])
def test_the_tokens_through_each_link_grow_to_the_prompts_count(messages: tuple[dict[str, Any], ...],
                                                                tokens: int) -> None:
    chain = chain_of(view(*messages), tokens)
    counts = [link.tokens for link in chain]
    assert len(chain) == len(messages) + 1  # the tools, then each message
    assert counts == sorted(counts) and counts[-1] == tokens


def test_a_chain_rescaled_to_the_deployments_count_ends_at_it() -> None:
    chain = chain_of(view(SYSTEM, TASK, CALL, RESULT), 1000)
    scaled = rescaled(chain, 2200)
    assert scaled[-1].tokens == 2200 and [x.digest for x in scaled] == [x.digest for x in chain]
    assert rescaled(chain, 0) == chain and rescaled(EMPTY_CHAIN, 10) == EMPTY_CHAIN
    assert scaled.digests is chain.digests  # shared, not copied


@pytest.mark.parametrize("text", ["", "ab12:10", "ab12:10,cd34:25"])
def test_a_chain_reads_back_as_stored(text: str) -> None:
    assert encode(decode(text)) == text


def test_a_damaged_stored_chain_keeps_what_is_before_the_damage() -> None:
    assert decode("ab:10,cd:x,ef:30") == Chain.of([("ab", 10)])


@pytest.mark.parametrize(("steps", "home", "stay"), [
    (["fast"], "fast", 1),
    (["fast", "fast", "fast"], "fast", 3),
    (["fast", "hq"], "hq", 1),
    (["hq", "fast", "fast"], "fast", 2),
])
def test_the_record_follows_where_the_steps_went(steps: list[str], home: str, stay: int) -> None:
    record = NO_PREFIXES
    for n, deployment in enumerate(steps):
        record = after_serving(record, deployment, Chain.of([(f"d{n}", n)]))
    assert (record.home, record.stay) == (home, stay)
    assert record.served[steps[-1]] == Chain.of([(f"d{len(steps) - 1}", len(steps) - 1)])


def test_the_tools_as_sent_are_hashed_as_they_are() -> None:
    raw = json.dumps(view(SYSTEM, TASK), indent=1).encode()  # a client's own spacing
    src = Source(raw, json_body.decode(raw))
    body = dict(src.body)
    as_sent = chain_of(body, 1000, src.member_as_sent("tools", body["tools"]))
    encoded = chain_of(body, 1000)
    assert as_sent[0].digest != encoded[0].digest  # the tools' own bytes, not their JSON encoded again
    assert chain_of(body, 1000, src.member_as_sent("tools", body["tools"])) == as_sent


@pytest.mark.parametrize("changed", [
    {**RESULT, "tool_call_id": "c2"},  # the call a result answers
    {**CALL, "tool_calls": [{**CALL["tool_calls"][0], "id": "c9"}]},  # a call's id
    {**CALL, "tool_calls": [{**CALL["tool_calls"][0], "function": {"name": "sh", "arguments": "{\"c\":\"ls\"}"}}]},
    {**TASK, "content": [{"type": "text", "text": TASK["content"]}]},  # the same text as parts
])
def test_what_a_message_says_and_answers_is_in_its_link(changed: dict[str, Any]) -> None:
    original = next(m for m in (RESULT, CALL, TASK) if m["role"] == changed["role"])
    messages = [SYSTEM, TASK, CALL, RESULT]
    edited = [changed if m is original else m for m in messages]
    at = messages.index(original) + 1  # the tools' link first
    same, other = chain_of(view(*messages), 1000), chain_of(view(*edited), 1000)
    assert same[at - 1].digest == other[at - 1].digest and same[at].digest != other[at].digest


_TEXT = st.text(st.characters(blacklist_categories=()))  # lone surrogates too, as JSON text may carry them
_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | _TEXT,
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
                     max_leaves=12)


@given(st.lists(_JSON | st.fixed_dictionaries(
    {"role": _JSON, "content": _JSON},
    optional={"tool_call_id": _JSON, "tool_calls": st.lists(_JSON | st.fixed_dictionaries(
        {"id": _JSON, "function": _JSON | st.fixed_dictionaries({"name": _JSON, "arguments": _JSON})}), max_size=3)}),
    max_size=6), _JSON)
def test_any_json_shape_gives_a_chain_and_the_same_one_twice(messages: list[Any], tools: Any) -> None:
    # what a client may send where the gateway reads a chat view: lone surrogates, NaN, calls of any shape
    body = {"messages": messages, "tools": tools}
    chain = chain_of(body, 500)
    assert chain == chain_of(body, 500)
    assert len(chain) == bool(tools) + sum(isinstance(m, dict) for m in messages)
    assert all(len(link.digest) == 16 for link in chain)


def test_a_lone_surrogate_in_a_content_of_parts_or_the_tools_gives_a_chain() -> None:
    # json reads "\ud800" as a lone surrogate where msgspec refuses it: such a body reaches the chain
    parts = {"role": "user", "content": [{"type": "text", "text": "\ud800"}]}
    chain = chain_of(view(SYSTEM, parts, tools=[{"name": "\ud800"}]), 100)
    assert len(chain) == 3 and chain != chain_of(view(SYSTEM, TASK), 100)


def test_messages_read_through_the_parse_memory_link_as_their_copies_do_step_after_step() -> None:
    memory = Recurring(1 << 20)
    long_result = {**RESULT, "content": "parser.py tests/\n" * 200}
    steps = [view(SYSTEM, TASK, CALL, long_result), view(SYSTEM, TASK, CALL, long_result, CALL, RESULT),
             view(SYSTEM, TASK, CALL, long_result)]  # the second step's end dropped: the first step's links again
    for step in steps:
        raw = json.dumps({**step, "pad": "p" * json_body.RECURRING_MIN_BODY}).encode()
        body = json_body.read(raw, "messages", memory).body
        noted = chain_of(body, 1000, None, memory)
        assert noted == chain_of(json.loads(raw), 1000)  # the same links as a fresh parse's, noted or not
        assert memory.notes(body["messages"][3]) is not None  # the long result is kept, with its note
    edited = {**body, "messages": [*body["messages"][:3], {**long_result, "content": "masked"}]}
    digests = [link.digest for link in chain_of(edited, 1000, None, memory)]
    assert digests[:4] == [link.digest for link in noted[:4]]  # an edit parts the chain where it is, only there
    assert digests[4] != noted[4].digest


_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": st.text(max_size=20) | st.none()},
    optional={"tool_call_id": st.text(max_size=3), "tool_calls": st.lists(st.fixed_dictionaries(
        {"id": st.text(max_size=3), "function": st.fixed_dictionaries({"name": st.text(max_size=4),
                                                                       "arguments": st.text(max_size=30)})}),
        max_size=2)}) | st.integers()
_LONG = {"role": "system", "content": "s" * 300}  # a conversation the memory finds by its head (4 KB at least)


def _through_memory(memory: Recurring, messages: list[Any], tools: Any) -> tuple[Any, Source]:
    raw = json.dumps({"messages": messages, "tools": tools, "pad": "p" * json_body.RECURRING_MIN_BODY}).encode()
    sent = json_body.read(raw, "messages", memory)
    tools_sent = sent.member_as_sent("tools", sent.body.get("tools"))
    return chain_of(sent.body, 5000, tools_sent, memory, sent.conversation), sent


@given(st.lists(_MESSAGE, max_size=8), st.lists(_MESSAGE, min_size=1, max_size=3), st.integers(0, 8),
       st.sampled_from([None, [], TOOLS, [{"type": "function", "function": {"name": "grep"}}]]))
def test_a_step_that_continues_a_kept_conversation_links_as_a_fresh_parse_does(
        messages: list[Any], added: list[Any], cut: int, other_tools: Any) -> None:
    memory = Recurring(1 << 20)
    head = [_LONG] * 16
    steps = [(head + messages, TOOLS), (head + messages + added, TOOLS), (head + messages + added * 2, other_tools),
             (head + messages[:cut] + added, TOOLS), (head + messages[:cut] + added * 2, TOOLS)]
    for messages_sent, tools in steps:  # continued, continued with other tools, rewound, continued
        chain, sent = _through_memory(memory, messages_sent, tools)
        assert chain == chain_of(json.loads(sent.raw), 5000, sent.member_as_sent("tools", sent.body.get("tools")))


def test_a_continued_step_hashes_only_the_messages_it_adds(monkeypatch: pytest.MonkeyPatch) -> None:
    memory = Recurring(8 << 20)
    steps = agent_bodies.session(5, 60 * 1024, 3_000, steps=4)
    linked: list[str] = []
    hex_of, hash_of = prefix._HEX, prefix._hash
    tools_hashed: list[int] = []
    monkeypatch.setattr(prefix, "_HEX", lambda digest: linked.append(hex_of(digest)) or linked[-1])
    monkeypatch.setattr(prefix, "_hash", lambda data, seed: (seed == prefix._TOOLS_SEED and tools_hashed.append(1))
                        or hash_of(data, seed))
    for i, step in enumerate(steps):
        linked.clear()
        chain, _ = _through_memory(memory, step["messages"], step["tools"])
        assert len(chain) == 1 + len(step["messages"])  # the tools' link, then one per message
        added = len(step["messages"]) - len(steps[i - 1]["messages"]) if i else len(step["messages"])
        assert len(linked) == 1 + added  # the tools' link, then the added messages'
        assert linked == [*chain.digests[:1], *chain.digests[-added:]]
    assert len(tools_hashed) == 1  # the same schemas at every step: hashed at the first, noted on their parse
