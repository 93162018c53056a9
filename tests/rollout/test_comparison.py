"""Comparison of shadow pairs on real-shaped OpenAI responses and SSE chunk lists, and the report."""

from __future__ import annotations

import json
from typing import Any

from gateway.rollout.comparison import Capture, assemble, compare, format_report, similarity, summarize


def chat_body(
    content: str | None, finish: str = "stop", tokens: int = 5, tool_calls: Any = None
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls is not None:
        message["tool_calls"] = tool_calls
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1732890000,
        "model": "tiny",
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
        "usage": {"prompt_tokens": 12, "completion_tokens": tokens, "total_tokens": 12 + tokens},
    }


def sse(*deltas: dict[str, Any], finish: str = "stop", tokens: int = 5) -> list[dict[str, Any]]:
    base = {"id": "chatcmpl-2", "object": "chat.completion.chunk", "created": 1732890000, "model": "tiny"}
    chunks = [
        {
            **base,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
        }
    ]
    chunks += [{**base, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    chunks.append(
        {
            **base,
            "choices": [],
            "usage": {"prompt_tokens": 12, "completion_tokens": tokens, "total_tokens": 12 + tokens},
        }
    )
    return chunks


def tool_call(name: str, args: str) -> dict[str, Any]:
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": args}}


def test_assemble_a_stream_with_split_tool_call_arguments() -> None:
    chunks = sse(
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]},
        finish="tool_calls",
        tokens=9,
    )
    done = assemble(Capture(200, 80.0, 20.0, chunks=chunks))
    assert done.tool_calls == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    assert (done.finish_reason, done.completion_tokens, done.text) == ("tool_calls", 9, "")


def test_streamed_and_plain_answers_compare_equal_at_temperature_zero() -> None:
    request = {
        "model": "auto",
        "temperature": 0,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    primary = Capture(200, 120.0, 30.0, chunks=sse({"content": "Hello"}, {"content": ", world."}))
    shadow = Capture(200, 90.0, 12.0, body=chat_body("Hello, world."))
    record = compare(request, primary, shadow)
    assert record["exact_match"] is True and record["similarity"] == 1.0 and record["finish_reason_match"]
    assert record["outcome"] == "tie"
    assert record["primary"]["ttft_ms"] == 30.0 and record["shadow"]["completion_tokens"] == 5
    json.dumps(record)  # JSON-serialisable as exported


def test_json_mode_validity_decides_the_outcome() -> None:
    request = {"model": "auto", "temperature": 0.7, "response_format": {"type": "json_object"}}
    record = compare(
        request, Capture(200, 50.0, body=chat_body('{"a": 1}')), Capture(200, 40.0, body=chat_body('{"a": 1'))
    )
    assert record["primary"]["json_valid"] is True and record["shadow"]["json_valid"] is False
    assert record["exact_match"] is None  # only meaningful at temperature 0
    assert record["outcome"] == "loss"


def test_tool_call_validity_checks_names_and_arguments() -> None:
    request = {"model": "auto", "tools": [{"type": "function", "function": {"name": "get_weather"}}]}
    good = Capture(
        200,
        50.0,
        body=chat_body(None, "tool_calls", tool_calls=[tool_call("get_weather", '{"city":"Oslo"}')]),
    )
    unknown = Capture(200, 50.0, body=chat_body(None, "tool_calls", tool_calls=[tool_call("launch", "{}")]))
    broken = Capture(
        200, 50.0, body=chat_body(None, "tool_calls", tool_calls=[tool_call("get_weather", "{city")])
    )
    assert compare(request, good, unknown)["shadow"]["tool_calls_valid"] is False
    assert compare(request, broken, good)["outcome"] == "win"


def test_a_failed_shadow_loses_and_a_failed_primary_wins() -> None:
    ok = Capture(200, 50.0, body=chat_body("fine"))
    timeout = Capture(0, 30_000.0, error="timeout")
    assert compare({}, ok, timeout)["outcome"] == "loss"
    assert compare({}, Capture(502, 5.0, body={"error": {"message": "x"}}), ok)["outcome"] == "win"
    assert compare({}, ok, timeout)["similarity"] is None


def test_similarity_is_bounded_token_set_jaccard() -> None:
    assert similarity("", "") == 1.0
    assert similarity("the cat sat", "the cat sat") == 1.0
    assert similarity("a b c d", "a b x y") == 2 / 6
    assert similarity("x " * 100_000, "y " * 100_000) == 0.0


def test_summarize_gives_rates_medians_and_win_share_with_intervals() -> None:
    request = {"model": "auto", "temperature": 0}
    records = []
    for i in range(40):
        text = "same answer" if i % 4 else "other answer"
        records.append(
            compare(
                request,
                Capture(200, 100.0 + i, 20.0 + i, body=chat_body("same answer")),
                Capture(200, 80.0 + i, 10.0 + i, body=chat_body(text, tokens=4)),
            )
        )
    summary = summarize(records)
    exact = summary["rates"]["exact_match"]
    assert (exact["k"], exact["n"], exact["rate"]) == (30, 40, 0.75)
    assert exact["interval"][0] < 0.75 < exact["interval"][1]
    ttft = summary["medians"]["ttft_ms shadow-primary"]
    assert (ttft["n"], ttft["median"], ttft["interval"]) == (40, -10.0, [-10.0, -10.0])
    assert summary["medians"]["completion_tokens shadow/primary"]["median"] == 0.8
    assert summary["outcomes"] == {"win": 0, "loss": 0, "tie": 40, "unusable": 0}
    text = format_report(summary)
    assert "shadow pairs: 40" in text and "exact_match" in text and "inconclusive" in text
    json.dumps(summary)


def test_a_shadow_cut_short_by_its_own_cap_is_unusable_not_a_loss() -> None:
    json_request = {"model": "m", "messages": [], "response_format": {"type": "json_object"}}
    primary = Capture(200, 900.0, body=chat_body('{"answer": "a long and complete object"}', tokens=700))
    cut = Capture(200, 400.0, body=chat_body('{"answer": "a long and', finish="length", tokens=512))
    record = compare(json_request, primary, cut, shadow_cap_tokens=512)
    assert record["shadow_truncated"] is True and record["outcome"] == "unusable"
    assert compare(json_request, primary, cut)["outcome"] == "loss"  # without the cap known: the old bias
    # the client's own cap bound both sides alike: a fair comparison, and invalid JSON is a loss
    own_cap = {**json_request, "max_tokens": 300}
    assert compare(own_cap, primary, cut, shadow_cap_tokens=512)["outcome"] == "loss"
    summary = summarize([record])
    assert summary["outcomes"]["unusable"] == 1 and "1 unusable" in format_report(summary)
