"""A deployment's body built over the request's own bytes: the same JSON as encoding it whole, members kept as sent."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from gateway.apis import json_body
from gateway.apis.chat import wire as chat_wire
from gateway.apis.json_body import Source
from gateway.apis.messages import wire as messages
from gateway.apis.responses import wire as responses

# Spacing, escapes and number spellings a re-encode would not keep; a key named "model" deeper down.
RAW = (b'{ "messages" : [{"role": "user", "content": "caf\\u00e9 \\"model\\": 1.50e1"}],\n'
       b' "tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"model": {}}}}}],'
       b' "model": "auto", "stream": true, "temperature": 1.0 }')


def source(raw: bytes) -> Source:
    return Source(raw, json_body.decode(raw))


def test_only_the_edited_members_change_and_the_others_are_sent_byte_for_byte() -> None:
    src = source(RAW)
    sent, wants_usage = chat_wire.upstream_body(dict(src.body), "served", 64, endpoint="chat", source=src)
    assert not wants_usage
    assert json.loads(sent) == {**json.loads(RAW), "model": "served", "max_completion_tokens": 64,
                                "stream_options": {"include_usage": True}}
    assert b'"content": "caf\\u00e9 \\"model\\": 1.50e1"' in sent  # as the client wrote it
    assert b'"temperature":1.0' in sent
    assert sent.count(b'"model"') == 2  # the nested one kept, the top-level one rewritten once


def test_a_member_the_relay_adds_to_a_copy_is_encoded_and_the_rest_copied() -> None:
    src = source(RAW)
    sent, _ = chat_wire.upstream_body({**src.body, "return_token_ids": True}, "served", source=src)
    assert json.loads(sent)["return_token_ids"] is True
    assert json.loads(sent)["model"] == "served"


def test_without_a_source_or_for_what_the_scan_refuses_the_body_is_encoded_whole() -> None:
    src = source(RAW)
    assert chat_wire.upstream_body(dict(src.body), "m", source=None)[0] == json_body.encode(
        {**src.body, "model": "m", "stream_options": {"include_usage": True}})
    nan = source(b'{"model": "auto", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}')
    assert chat_wire.upstream_body(dict(nan.body), "m", source=nan)[0] == json_body.encode({**nan.body, "model": "m"})


def test_a_repeated_member_goes_as_the_parse_read_it() -> None:
    src = source(b'{"model": "a", "messages": [], "model": "b", "n": 1, "n": 2}')
    sent = json.loads(chat_wire.upstream_body(dict(src.body), "served", source=src)[0])
    assert sent == {"model": "served", "messages": [], "n": 2}


def test_a_source_whose_parse_is_not_the_body_is_not_used() -> None:
    src = Source(b'{"model": "a", "other": 1}', {"model": "a"})  # a body parsed from other bytes
    assert json.loads(json_body.encode_edited({"model": "b"}, src)) == {"model": "b"}


def test_messages_and_responses_bodies_are_built_over_their_bytes_too() -> None:
    raw = b'{"model": "auto", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}'
    src = source(raw)
    sent = json.loads(messages.upstream_body(dict(src.body), "served", 50, src)[0])
    assert sent == {"model": "served", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}
    raw = b'{"model": "auto", "input": "hi", "previous_response_id": "resp_1", "store": true}'
    src = source(raw)
    assert json.loads(responses.upstream_body(dict(src.body), "served", None, src)[0]) == {
        "model": "served", "input": "hi", "store": False}


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                    max_leaves=12)


@given(st.dictionaries(st.text(max_size=6), JSON, max_size=5), st.text(max_size=6), st.booleans(),
       st.sampled_from([None, 7]))
def test_the_upstream_body_parses_to_what_encoding_it_whole_gives(
    members: dict[str, Any], model: str, stream: bool, cap: int | None
) -> None:
    raw = json.dumps({**members, "model": "auto", "stream": stream}, indent=1).encode()
    src = source(raw)
    whole = chat_wire.upstream_body(dict(src.body), model, cap, endpoint="chat")
    over_bytes = chat_wire.upstream_body(dict(src.body), model, cap, endpoint="chat", source=src)
    assert json.loads(over_bytes[0]) == json.loads(whole[0])
    assert over_bytes[1] == whole[1]


def test_a_member_still_as_parsed_reads_as_its_bytes_as_sent() -> None:
    src = source(RAW)
    assert src.member_as_sent("tools", src.body["tools"]) == json.dumps(json.loads(RAW)["tools"]).encode()
    assert src.member_as_sent("tools", list(src.body["tools"])) is None  # an edited copy is no longer as sent
    assert src.member_as_sent("absent", None) is None


def test_a_body_the_scan_refuses_has_nothing_as_sent() -> None:
    for raw in (b'{"tools": [{"type": "function", "x": NaN}]}', b'{"tools": [{"type": "\\ud800"}]}'):
        src = source(raw)
        assert src.members() is None
        assert src.member_as_sent("tools", src.body["tools"]) is None
