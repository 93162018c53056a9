"""apis/recurring.py: a conversation's messages parsed once, however many steps re-send them."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import agent_bodies
from gateway.apis import json_body, recurring
from gateway.apis.recurring import Recurring, resume
from gateway.errors import BadRequest


def _steps() -> list[bytes]:
    return [json.dumps(step).encode() for step in agent_bodies.session(7, 40 * 1024, 2_000, steps=3)]


def test_a_step_reads_as_decode_reads_it_and_its_resent_messages_are_the_earlier_parses() -> None:
    memory = Recurring(8 << 20)
    first, second, third = _steps()
    one = json_body.read(first, "messages", memory)
    two = json_body.read(second, "messages", memory)
    assert one.body == json_body.decode(first) and two.body == json_body.decode(second)
    old, new = len(one.body["messages"]), len(two.body["messages"])
    assert new == old + 2  # one more tool call and its result
    assert all(a is b for a, b in zip(one.body["messages"], two.body["messages"], strict=False))
    assert two.body["tools"] is one.body["tools"]  # the same 24 schemas at every step
    assert two.body["messages"] is not one.body["messages"]  # each body its own list: a stage may build on it
    assert two.members() is not None and two.members().keys() == two.body.keys()  # the scan read once, kept
    assert json_body.read(third, "messages", memory).body["messages"][old] is two.body["messages"][old]


def test_a_short_body_or_no_memory_is_parsed_whole() -> None:
    memory = Recurring(8 << 20)
    small = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    assert json_body.read(small, "messages", memory).body == json.loads(small)
    assert len(memory) == 0
    first = _steps()[0]
    assert json_body.read(first, "messages", None).body == json.loads(first)


def test_what_is_kept_is_bounded_by_its_bytes_and_the_least_recently_sent_goes_first() -> None:
    first, second, _ = _steps()
    memory = Recurring(20 * 1024)
    json_body.read(first, "messages", memory)
    assert 0 < memory.kept_bytes <= 20 * 1024 and memory.conversation_bytes == 0  # a conversation over the bound
    kept = list(memory.kept())
    assert sum(len(raw) for raw, _ in kept) == memory.kept_bytes
    newest = json_body.read(second, "messages", memory).body["messages"][-1]
    assert memory.notes(newest) is not None and memory.kept_bytes <= 20 * 1024  # kept, the oldest dropped
    assert memory.notes(kept[0][1]) is None  # dropped with its notes: an id may be reused once it is gone
    assert Recurring(0).member(msgspec.Raw(b'[' + b'1,' * 600 + b'1]')) == [1] * 601


def _conversation(n: int) -> list[dict[str, Any]]:
    return [{"role": "user" if i % 2 else "assistant", "content": f"step {i}"} for i in range(n)]


def _raw(messages: list[Any], separators: tuple[str, str] = (",", ":")) -> bytes:
    return json.dumps({"model": "m", "messages": messages, "pad": "p" * json_body.RECURRING_MIN_BODY},
                      separators=separators).encode()


def test_a_conversation_that_continues_a_kept_one_takes_its_parses_however_short_its_messages() -> None:
    memory = Recurring(8 << 20)
    first = json_body.read(_raw(_conversation(300)), "messages", memory).body["messages"]
    assert len(memory) == 0  # each message under MIN_KEPT: none kept alone
    second = json_body.read(_raw(_conversation(302)), "messages", memory).body["messages"]
    assert all(a is b for a, b in zip(first, second[:300], strict=True))
    assert second == _conversation(302) and memory.conversation_bytes <= len(_raw(_conversation(302)))
    again = json_body.read(_raw(_conversation(302)), "messages", memory).body["messages"]
    assert again == second and again is not second and again[301] is second[301]  # the same step again


@pytest.mark.parametrize("later", [
    [*_conversation(300), 1],  # a number after it: its digits must not run on
    _conversation(299),  # shorter: a step rewound
    [*_conversation(299), {"role": "user", "content": "step 299 edited"}],  # its last message edited
    [{"role": "system", "content": "other"}, *_conversation(300)[1:]],  # another head
])
def test_what_does_not_continue_a_kept_conversation_is_read_as_it_is(later: list[Any]) -> None:
    memory = Recurring(8 << 20)
    json_body.read(_raw([*_conversation(300)[:-1], 12]), "messages", memory)  # ends on 12: [.., 1] is its prefix
    for spacing in ((",", ":"), (", ", ": ")):
        assert json_body.read(_raw(later, spacing), "messages", memory).body["messages"] == later


def _read(raw: bytes, memory: Recurring) -> json_body.Source:
    """json_body.read through the memory, checked against a plain parse and a scan of the members' bytes."""
    source = json_body.read(raw, "messages", memory)
    assert source.body == json.loads(raw)
    members = source.members()
    assert members is not None
    assert {name: bytes(value) for name, value in members.items()} == {
        name: bytes(value) for name, value in json_body._MEMBERS.decode(raw).items()}
    return source


class _CountingScan:
    def __init__(self) -> None:
        self.scans = 0

    def decode(self, raw: bytes) -> Any:
        self.scans += 1
        return json_body._MEMBERS.decode(raw)


def test_a_step_that_adds_messages_to_the_step_before_is_read_without_a_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its members sit where the step before's did: only the added messages are parsed, and each member still
    reads as the bytes it was sent as (the deployment is sent those)."""
    scan = _CountingScan()
    monkeypatch.setattr(recurring, "MEMBERS", scan)
    memory = Recurring(8 << 20)
    first, second, third = _steps()
    one = _read(first, memory)
    assert scan.scans == 1
    two, three = _read(second, memory), _read(third, memory)
    assert scan.scans == 1  # neither the second nor the third step scanned
    assert all(a is b for a, b in zip(one.body["messages"], two.body["messages"], strict=False))
    assert two.body["tools"] is one.body["tools"] and three.body["tools"] is one.body["tools"]
    assert three.body["model"] == "auto" and memory.conversation_bytes <= len(third)
    _read(second, memory)  # a step sent again (a client's retry): not a continuation of the third
    assert scan.scans == 2


def test_a_continued_steps_long_members_are_the_kept_values_neither_hashed_nor_compared_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The frame's bytes around the conversation are the step before's, so its tools (10-50 KB of schemas on an
    agent's step) are taken as kept; they still count as sent again (the least recently sent go first)."""
    memory = Recurring(8 << 20)
    first, second, third = _steps()
    one = _read(first, memory)
    tools = one.members()["tools"]  # type: ignore[index]
    hashed: list[bytes] = []
    digest = recurring.xxhash.xxh3_128_intdigest
    monkeypatch.setattr(recurring.xxhash, "xxh3_128_intdigest", lambda data: hashed.append(bytes(data)) or digest(data))
    two, three = _read(second, memory), _read(third, memory)
    assert two.body["tools"] is one.body["tools"] and three.body["tools"] is one.body["tools"]
    assert hashed and bytes(tools) not in hashed  # the added messages were, the tools were not
    newest = next(reversed(memory._by_digest.values())).value
    assert newest is one.body["tools"]  # sent again after the third step's messages: the most recently sent


def test_a_step_resumes_what_a_stage_noted_of_the_step_it_continues_and_nothing_else() -> None:
    memory = Recurring(8 << 20)
    first, second, third = _steps()
    one = _read(first, memory)
    earlier, start, noting = resume(one.conversation, one.body["messages"], "tally")
    assert earlier is None and start == 0 and noting is not None  # a first step: nothing before it
    noting["tally"] = len(one.body["messages"])
    two = _read(second, memory)
    messages = two.body["messages"]
    earlier, start, noting = resume(two.conversation, messages, "tally")
    assert (earlier, start) == (len(one.body["messages"]), len(one.body["messages"])) and noting is not None
    assert resume(two.conversation, messages, "other") == (None, 0, noting)  # what no stage noted: from the start
    noting["tally"] = len(messages)
    edited = {**messages[-1], "content": "edited"}
    for other in ([*messages[:-1], edited], messages[:-1], [*messages, messages[-1]], tuple(messages)):
        assert resume(two.conversation, other, "tally") == (None, 0, None)  # a view the gateway built, an edit
    equal = [*messages[:-1], {**messages[-1]}]  # other objects of equal values: their tallies are equal
    assert resume(two.conversation, equal, "tally")[0] == len(one.body["messages"])
    assert resume(None, messages, "tally") == (None, 0, None)
    three = _read(third, memory)
    assert resume(three.conversation, three.body["messages"], "tally")[:2] == (len(messages), len(messages))
    retried = _read(second, memory)  # a client's retry of the second step: no step before it is kept
    assert resume(retried.conversation, retried.body["messages"], "tally")[:2] == (None, 0)


@pytest.mark.parametrize("edit", [
    lambda body: {**body, "max_tokens": 17},  # a member after the conversation changed
    lambda body: {"model": "fast", **{k: v for k, v in body.items() if k != "model"}},  # one before it
    lambda body: {**body, "stream": True},  # a member added at the end
    lambda body: {k: v for k, v in body.items() if k != "max_tokens"},  # one dropped
    lambda body: {**body, "messages": body["messages"][:-1]},  # the conversation rewound
    lambda body: {**body, "messages": [*body["messages"][:-1], {"role": "user", "content": "edited"}]},
])
def test_a_step_that_changes_more_than_its_conversations_end_is_read_as_it_is(edit: Any) -> None:
    memory = Recurring(8 << 20)
    steps = agent_bodies.session(7, 40 * 1024, 2_000, steps=2)
    _read(json.dumps(steps[0]).encode(), memory)
    _read(json.dumps(edit(steps[1])).encode(), memory)
    _read(json.dumps(steps[1]).encode(), memory)


@pytest.mark.parametrize("size", [40 * 1024, 70 * 1024])  # its head's digest taken at one length, or past one
def test_a_continued_step_is_found_by_its_conversation_when_a_member_changes_the_step_after(
        monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    """A step read without a scan is kept under the digests its next steps are found by: the body's first bytes
    (taken by the lookup that found the step before) and its conversation's (the step before's, when it holds as
    many bytes), whichever path the next step takes."""
    scan = _CountingScan()
    monkeypatch.setattr(recurring, "MEMBERS", scan)
    memory = Recurring(8 << 20)
    steps = agent_bodies.session(9, size, 2_000, steps=4)
    third = [_read(json.dumps(step).encode(), memory) for step in steps[:3]][-1]
    assert scan.scans == 1  # the second and third steps were read without a scan
    noting = resume(third.conversation, third.body["messages"], "mark")[2]
    assert noting is not None
    noting["mark"] = "the third step's"
    changed = _read(json.dumps({**steps[3], "max_tokens": 99}).encode(), memory)  # scanned, then found by its head
    assert scan.scans == 2
    assert resume(changed.conversation, changed.body["messages"], "mark")[:2] == (
        "the third step's", len(third.body["messages"]))  # it continued the third step's conversation


@pytest.mark.parametrize("raw", [
    rb'{"mod\u0065l": "m", "messages": [' + b'{"role": "user", "content": "x"}, ' * 600 + b'1]}',  # an escaped key
    b'{"model": "m", "model": "n", "messages": [' + b'{"role": "user", "content": "x"}, ' * 600 + b'1]}',  # twice
    b'{"messages": [' + b'{"role": "user", "content": "x"}, ' * 600 + b'1], "pad": "p"}  ',  # no key before it
])
def test_a_body_written_otherwise_still_reads_as_decode_reads_it_step_after_step(raw: bytes) -> None:
    memory = Recurring(8 << 20)
    assert json_body.read(raw, "messages", memory).body == json.loads(raw)
    longer = raw.replace(b"1]", b'1, {"role": "tool", "content": "y"}]')
    assert json_body.read(longer, "messages", memory).body == json.loads(longer)


def test_the_least_recently_sent_is_dropped_first() -> None:
    memory = Recurring(2500)
    a, b, c = (msgspec.Raw(json.dumps({"content": letter * 1000}).encode()) for letter in "abc")
    kept_a, kept_b = memory.member(a), memory.member(b)
    assert memory.member(a) is kept_a  # sent again: now the most recent
    memory.member(c)
    assert memory.notes(kept_b) is None and memory.notes(kept_a) is not None
    assert memory.member(b) is not kept_b  # parsed again


def test_equal_digests_of_other_bytes_are_parsed_not_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recurring.xxhash, "xxh3_128_intdigest", lambda data: 1)  # every digest collides
    monkeypatch.setattr(recurring.xxhash, "xxh3_64_intdigest", lambda data: 1)  # every head too
    memory = Recurring(8 << 20)
    a = msgspec.Raw(json.dumps({"role": "tool", "content": "a" * 2000}).encode())
    b = msgspec.Raw(json.dumps({"role": "tool", "content": "b" * 2000}).encode())
    assert memory.member(a)["content"] == "a" * 2000
    for n in (300, 200, 301):  # every conversation under one head: told apart by their bytes
        assert json_body.read(_raw(_conversation(n)), "messages", memory).body["messages"] == _conversation(n)
    assert memory.member(b)["content"] == "b" * 2000
    assert memory.member(a)["content"] == "a" * 2000


def test_notes_belong_to_the_kept_value_alone() -> None:
    memory = Recurring(8 << 20)
    raw = msgspec.Raw(json.dumps({"role": "user", "content": "x" * 2000}).encode())
    value = memory.member(raw)
    notes = memory.notes(value)
    assert notes == {} and memory.notes(value) is notes
    assert memory.notes(dict(value)) is None  # an equal copy is not the kept value


@pytest.mark.parametrize("raw, message", [
    (b'{"model": "m", "messages": [{"role": "user", "content": NaN}]' + b' ' * 20000 + b'}', None),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\\ud83d"}]' + b' ' * 20000 + b'}', None),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}' + b' ' * 20000, "not valid JSON"),
    (b'[' + b' ' * 20000 + b']', "must be a JSON object"),
    (b'{"model": "m", "messages": "' + b'x' * 20000 + b'"}', None),
    (b'{"model": "m", "model": "n", "messages": []' + b' ' * 20000 + b'}', None),
])
def test_what_the_scan_refuses_is_decodes_verdict(raw: bytes, message: str | None) -> None:
    memory = Recurring(8 << 20)
    if message is None:
        assert json_body.read(raw, "messages", memory).body == json_body.decode(raw)
    else:
        with pytest.raises(BadRequest, match=message):
            json_body.read(raw, "messages", memory)


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                     | st.text(), lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner), max_leaves=20)


@settings(max_examples=80, deadline=None)
@given(st.lists(_JSON, max_size=12), st.lists(_JSON, max_size=4), st.dictionaries(st.text(), _JSON, max_size=4),
       st.sampled_from([None, 1]), st.integers(0, 12))
def test_any_conversation_reads_as_decode_reads_it_step_after_step(
        messages: list[Any], added: list[Any], others: dict[str, Any], indent: int | None, cut: int) -> None:
    memory = Recurring(1 << 20)
    pad = "p" * json_body.RECURRING_MIN_BODY
    head = [{"role": "system", "content": "s" * 300}] * 20  # long enough to be found by its head
    steps = [head + messages, head + messages + added, head + messages[:cut] + added, head + messages + added]
    for step in steps:  # parsed, continued, rewound and edited, continued again
        raw = json.dumps({**others, "messages": step, "pad": pad}, indent=indent).encode()
        _read(raw, memory)
