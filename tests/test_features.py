"""Request -> Features extraction on the request shapes clients really send."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import agent_bodies
from gateway import features
from gateway.apis import json_body
from gateway.apis.recurring import Recurring, resume
from gateway.features import LAST_USER_TEXT_CHARS, extract


def chat(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": list(messages), **extra}


def test_encoding_is_the_offline_cl100k() -> None:
    encoding = features.load_encoding()
    assert encoding is not None
    assert encoding.encode_ordinary("hello world") == [15339, 1917]  # cl100k ids


def test_the_gateways_encoding_counts_as_tiktokens_own_in_15_mib_less() -> None:
    """The gateway's encoding gives its Python copy of the merge table back (tiktoken keeps it only to pickle)."""
    script = textwrap.dedent("""
        import json, re, sys
        def rss_mib():
            return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) / 1024
        import tiktoken
        from gateway import features
        before = rss_mib()
        ours = features.load_encoding()
        grown = rss_mib() - before
        theirs = tiktoken.get_encoding(features.ENCODING_NAME)
        texts = ["hello world", "def f(x):\\n    return x ** 2  # ok", "日本語のテキスト", "emoji 🎉 and \\udc80 lone"]
        same = all(ours.encode_ordinary(t) == theirs.encode_ordinary(t) for t in texts)
        print(json.dumps({"grown": grown, "same": same}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    figures = json.loads(out.stdout)
    assert figures["same"]
    assert figures["grown"] < 38, figures  # 30 MiB measured (Rust's tables and regexes); 45 with the dict kept


def test_small_chat_counts_by_part() -> None:
    f = extract(
        chat(
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "hello world"},
            {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "hello world again"},
        ),
        "chat",
    )
    assert (f.system_tokens, f.history_tokens, f.last_user_tokens) == (4, 3, 3)
    assert f.prompt_tokens == 10 and f.prompt_tokens_exact
    assert (f.message_count, f.user_turns, f.tool_result_turns, f.tools_count) == (4, 2, 0, 0)
    assert f.prior_answers == 1  # the assistant turn before the last user turn
    assert f.last_user_text == "hello world again"
    assert f.endpoint == "chat" and f.requested_model == "m"


def test_every_field_holds_its_own_value() -> None:
    # extract() builds Features positionally: a request where no two fields agree shows each in its place
    body = chat(
        {"role": "system", "content": "You are a terse assistant, please."},
        {"role": "user", "content": "hello"},
        {"role": "user", "content": "are you there?"},
        {"role": "assistant", "content": "hi, how can I help you today?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "run", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        {"role": "user", "content": "```python\ndef f():\n    return 1\n``` fix this function for me now, quickly"},
    ) | {"tools": [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}] * 4,
         "response_format": {"type": "json_object"}, "max_tokens": 77, "temperature": 0.25, "stream": True}
    f = extract(body, "chat")
    assert f.as_record(with_prompt=True) == {
        "endpoint": "chat", "requested_model": "m", "prompt_tokens": 118, "prompt_tokens_exact": True,
        "system_tokens": 8, "history_tokens": 18, "last_user_tokens": 20, "message_count": 7, "user_turns": 3,
        "tools_count": 4,
        "tool_result_turns": 1, "prior_answers": 2, "has_code": True, "has_math": False,
        "response_format": "json_object", "max_tokens": 77, "temperature": 0.25, "stream": True,
        "last_user_text": body["messages"][-1]["content"],
    }


CASES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    (
        "content parts: text kept, images dropped",
        chat(
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "hello world"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    {"type": "text", "text": "again"},
                ],
            }
        ),
        {"last_user_text": "hello world\nagain", "last_user_tokens": 4},
    ),
    (
        "None content and a missing role",
        chat({"role": "assistant", "content": None}, {"content": "x"}, {"role": "user", "content": None}),
        {"prompt_tokens": 1, "last_user_text": "", "message_count": 3, "user_turns": 1},
    ),
    (
        "agent turn: tool calls and tool results",
        chat(
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city":"Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp_c": 21}'},
            tools=[{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}],
        ),
        {
            "tools_count": 1,
            "tool_result_turns": 1,
            "user_turns": 1,
            "last_user_text": "What is the weather in Paris?",
        },
    ),
    (
        "response_format, max_completion_tokens, temperature, stream",
        chat(
            {"role": "user", "content": "json please"},
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
            max_completion_tokens=64,
            max_tokens=999,
            temperature=0,
            stream=True,
        ),
        {"response_format": "json_schema", "max_tokens": 64, "temperature": 0.0, "stream": True},
    ),
    (
        "odd types are ignored, not fatal",
        {
            "model": 3,
            "messages": "nope",
            "temperature": True,
            "max_tokens": "9",
            "stream": "yes",
            "tools": {},
        },
        {"requested_model": "", "message_count": 0, "temperature": None, "max_tokens": None, "stream": False},
    ),
    (
        "messages that are not objects are skipped",
        chat("hello", None, 7, {"role": "user", "content": "hi"}),
        {"message_count": 1, "user_turns": 1, "last_user_text": "hi"},
    ),
    (
        "code markers",
        chat({"role": "user", "content": "Why does this fail?\n```python\nprint(x)\n```"}),
        {"has_code": True, "has_math": False},
    ),
    (
        "math markers (LaTeX)",
        chat({"role": "user", "content": "Compute $\\int_0^1 x^2 dx$."}),
        {"has_math": True, "has_code": False},
    ),
    (
        "math markers (symbols)",
        chat({"role": "user", "content": "Is √2 ≤ 1.5?"}),
        {"has_math": True},
    ),
    (
        "a code marker inside a word is prose (himself., blueprint()",
        chat({"role": "user", "content": "He saw himself. The blueprint(s) malfunction(ed)."}),
        {"has_code": False},
    ),
    (
        "self. starting a word is code",
        chat({"role": "user", "content": "Why is self.items empty?"}),
        {"has_code": True},
    ),
    (
        "plain prose has neither marker",
        chat({"role": "user", "content": "Write a short poem about autumn leaves."}),
        {"has_math": False, "has_code": False},
    ),
    (
        "special-token text is counted, not rejected",
        chat({"role": "user", "content": "<|endoftext|>"}),
        {"prompt_tokens_exact": True},
    ),
]


@pytest.mark.parametrize(("name", "body", "expected"), CASES, ids=[c[0] for c in CASES])
def test_request_shapes(name: str, body: dict[str, Any], expected: dict[str, Any]) -> None:
    f = extract(body, "chat")
    assert {k: getattr(f, k) for k in expected} == expected


@pytest.mark.parametrize(
    ("endpoint", "body", "last_user_tokens", "history_tokens", "text"),
    [
        ("completions", {"prompt": "hello world"}, 2, 0, "hello world"),
        ("completions", {"prompt": ["hello", "hello world"]}, 2, 1, "hello world"),
        ("completions", {"prompt": [15339, 1917, 1917]}, 3, 0, ""),
        ("completions", {"prompt": [[1, 2], [3]]}, 1, 2, ""),
        ("embeddings", {"input": "hello world"}, 2, 0, "hello world"),
        ("completions", {"prompt": None}, 0, 0, ""),
    ],
)
def test_prompt_endpoints(
    endpoint: str, body: dict[str, Any], last_user_tokens: int, history_tokens: int, text: str
) -> None:
    f = extract(body, endpoint)
    assert (f.last_user_tokens, f.history_tokens, f.last_user_text) == (
        last_user_tokens,
        history_tokens,
        text,
    )
    assert f.endpoint == endpoint


def test_huge_prompt_is_estimated_and_bounded() -> None:
    body = chat(
        {"role": "user", "content": "lorem ipsum dolor sit amet " * 30_000 + "So what is the question?"}
    )
    started = time.perf_counter()
    f = extract(body, "chat")
    elapsed_s = time.perf_counter() - started
    assert not f.prompt_tokens_exact
    assert f.prompt_tokens == features.estimate_tokens(body["messages"][0]["content"])
    assert len(f.last_user_text) == LAST_USER_TEXT_CHARS
    assert f.last_user_text.endswith("So what is the question?")  # the tail, where the ask is, survives
    # exact counting would take ~50 ms here; the estimate is far below (generous bound for a busy CI box)
    assert elapsed_s < 0.025


def test_exact_budget_is_per_request() -> None:
    chunk = "word " * (features.EXACT_CHARS_PER_MESSAGE // 5 - 1)
    many = chat(*[{"role": "user", "content": chunk} for _ in range(6)])
    f = extract(many, "chat")
    assert not f.prompt_tokens_exact  # 6 x ~8k chars exceeds the 32k total
    assert extract(chat({"role": "user", "content": chunk}), "chat").prompt_tokens_exact


def test_missing_encoding_falls_back_with_a_warning(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    features.load_encoding.cache_clear()
    features.count_exact.cache_clear()
    monkeypatch.setattr(features, "ENCODING_NAME", "no_such_encoding")
    try:
        with caplog.at_level("WARNING"):
            f = extract(chat({"role": "user", "content": "hello world"}), "chat")
        assert not f.prompt_tokens_exact
        assert f.prompt_tokens == 3  # ceil(11 bytes / 4)
        assert "fall back" in caplog.text
    finally:
        features.load_encoding.cache_clear()
        features.count_exact.cache_clear()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(
            ["model", "messages", "tools", "prompt", "input", "response_format", "max_tokens", "stream"]
        ),
        json_values,
    ),
    st.sampled_from(["chat", "completions", "embeddings"]),
)
def test_extract_never_raises_on_json(body: dict[str, Any], endpoint: str) -> None:
    f = extract(body, endpoint)
    assert f.prompt_tokens >= 0 and len(f.last_user_text) <= LAST_USER_TEXT_CHARS


def test_a_record_of_the_features_keeps_what_a_user_wrote_only_when_asked() -> None:
    from gateway.features import extract

    features = extract({"model": "auto", "messages": [{"role": "user", "content": "my secret plan"}]}, "chat")
    record = features.as_record()
    assert "last_user_text" not in record and record["message_count"] == 1 and record["endpoint"] == "chat"
    assert features.as_record(with_prompt=True)["last_user_text"] == "my secret plan"


TOOLS = [{"type": "function", "function": {"name": "réserver", "description": "Book a table — 2 people, 8 pm ✓",
                                          "parameters": {"type": "object", "required": ["at"], "properties": {
                                              "at": {"type": "integer", "minimum": 0}, "vip": {"type": "boolean"},
                                              "note": {"type": ["string", "null"]}}}}}]


def test_tool_schemas_are_counted_as_their_compact_json() -> None:
    f = extract(chat({"role": "user", "content": "hi"}, tools=TOOLS), "chat")
    text = json.dumps([TOOLS, None], separators=(",", ":"), ensure_ascii=False)
    assert f.prompt_tokens == features.count_exact("hi") + features.count_exact(text)


def test_tool_schemas_json_cannot_encode_are_still_counted_and_never_raise() -> None:
    surrogate = [{"type": "function", "function": {"name": "f\udc80"}}]  # json.loads accepts a lone surrogate
    assert extract(chat({"role": "user", "content": "hi"}, tools=surrogate), "chat").prompt_tokens > 1
    odd = [{"type": "function", "function": {"name": "f", "parameters": {1, 2}}}]  # built in-process, not JSON
    assert extract(chat({"role": "user", "content": "hi"}, tools=odd), "chat").prompt_tokens > 1
    circular: dict[str, Any] = {"type": "function"}
    circular["self"] = circular
    assert extract(chat({"role": "user", "content": "hi"}, tools=[circular]), "chat").prompt_tokens == 1


def _with_tools(tools: list[dict[str, Any]]) -> tuple[dict[str, Any], memoryview | None]:
    from gateway.apis.json_body import Source, decode
    raw = json.dumps({"model": "auto", "messages": [{"role": "user", "content": "run the tests"}], "tools": tools},
                     indent=1).encode()  # a client's own spacing: the text counted is the schemas' compact JSON
    body = decode(raw)
    return body, Source(raw, body).member_as_sent("tools", body["tools"])


def test_tools_kept_by_their_bytes_as_sent_count_as_encoding_them_does() -> None:
    features._TOOL_TEXTS.clear()
    for n in range(features.TOOL_TEXTS_KEPT + 8):
        tools = [{"type": "function", "function": {"name": f"tool_{n}_{i}", "description": "x " * (n + i),
                                                   "parameters": {"type": "object"}}} for i in range(3)]
        body, sent = _with_tools(tools)
        assert sent is not None
        fresh, kept = extract(body, "chat", sent), extract(body, "chat", sent)  # the second from what was kept
        assert fresh == kept == extract(body, "chat")
        assert fresh.prompt_tokens > extract({**body, "tools": []}, "chat").prompt_tokens
    assert len(features._TOOL_TEXTS) == features.TOOL_TEXTS_KEPT


# ---- a conversation the parse memory keeps: the walk goes on from the step before's tallies ----------------------

_ROLES = ("system", "developer", "user", "user", "assistant", "assistant", "tool", "function", "critic")
_TEXT = st.text(max_size=40) | st.sampled_from(
    ["", "def f():\n    return 1", "prove the theorem", "self.x == 1", "∫ x dx", "x" * 5_000, "word " * 1_700])
_CALL = st.fixed_dictionaries({"id": st.text(max_size=3), "type": st.just("function"),
                               "function": st.fixed_dictionaries({"name": st.text(max_size=5), "arguments": _TEXT})})
_DICT = st.fixed_dictionaries({"role": st.sampled_from(_ROLES), "content": _TEXT | st.none()},
                              optional={"tool_calls": st.lists(_CALL, max_size=2)})
_MESSAGE = st.one_of(_DICT, _DICT, _DICT, _DICT, st.integers() | st.none())  # a few elements that are no message
_HEAD = [{"role": "system", "content": "s" * 300}] * 20  # long enough for the memory to find the conversation by


def _read_through(memory: Recurring, messages: list[Any]) -> tuple[features.Features, bytes, bool]:
    """The step's features read through the memory, its bytes, and whether its walk went on from the step before's."""
    raw = json.dumps({"model": "m", "messages": messages, "pad": "p" * json_body.RECURRING_MIN_BODY}).encode()
    sent = json_body.read(raw, "messages", memory)
    conversation = sent.conversation
    went_on = resume(conversation, sent.body["messages"], features._WALKED)[0] is not None
    return extract(sent.body, "chat", None, conversation), raw, went_on


@pytest.mark.parametrize("walker", ["native", "python"])
@settings(max_examples=100, deadline=None)
@given(st.lists(_MESSAGE, max_size=10), st.lists(_MESSAGE, min_size=1, max_size=4), st.integers(0, 10))
def test_a_step_that_continues_a_kept_conversation_reads_as_a_fresh_parse_does(
        walker: str, messages: list[Any], added: list[Any], cut: int) -> None:
    saved = features.native
    features.native = saved if walker == "native" else None
    try:
        memory = Recurring(1 << 20)
        steps = [_HEAD + messages, _HEAD + messages + added, _HEAD + messages + added + added,
                 _HEAD + messages[:cut] + added, _HEAD + messages[:cut] + added + messages]
        for i, step in enumerate(steps):  # a first step, two continued, a rewound one, continued again
            found, raw, went_on = _read_through(memory, step)
            assert found == extract(json.loads(raw), "chat")
            assert went_on or i not in (1, 2)  # the continued steps went on from the notes
    finally:
        features.native = saved


def test_a_continued_step_walks_only_the_messages_it_adds(monkeypatch: pytest.MonkeyPatch) -> None:
    memory = Recurring(8 << 20)
    steps = agent_bodies.session(11, 60 * 1024, 3_000, steps=4)
    walked = []
    monkeypatch.setattr(features, "_message_text", lambda m: walked.append(m) or features.text_of(m.get("content")))
    for i, step in enumerate(steps):
        walked.clear()
        assert _read_through(memory, step["messages"])[2] == (i >= 1)
        if i >= 1:  # what the step before noted: the call and the result it adds
            assert walked == step["messages"][len(steps[i - 1]["messages"]):]
