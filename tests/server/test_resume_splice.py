"""The pure part of resuming a broken stream: reading back what was sent, the continuation, the splice."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.apis.events import sse
from gateway.server import resume_splice as resume

HELLO = [{"role": "user", "content": "hi"}]


def _chunk(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def _chat(content: str | None = None, ids: list[int] | None = None, finish: str | None = None,
          **extra: Any) -> bytes:
    choice: dict[str, Any] = {"index": 0, "delta": {"content": content} if content is not None else {},
                              "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    return _chunk({"id": "c1", "object": "chat.completion.chunk", "created": 5, "model": "m", "choices": [choice],
                   **extra})


def _read_back(api: str, body: dict[str, Any], chunks: list[bytes], blocked: str | None) -> resume.Progress:
    transcript = resume.Transcript()
    for chunk in chunks:
        transcript.add(chunk)
    return resume.read_back(api, body, transcript, blocked)


def test_a_transcript_lets_go_of_a_stream_past_its_limit_and_a_resume_is_then_refused() -> None:
    transcript = resume.Transcript()
    piece = _chat("x" * 1024)
    for _ in range(resume.MAX_TRANSCRIPT_BYTES // len(piece) + 1):
        transcript.add(piece)
    assert not transcript.whole and transcript.chunks == []  # not kept: a long stream costs no more
    transcript.add(piece)
    assert transcript.chunks == []
    blocked = resume.read_back("chat", {"messages": HELLO}, transcript, None).blocked
    assert blocked == "the answer is too long to read back"


def test_transcripts_share_the_processs_memory_and_one_that_finds_it_full_lets_go_of_its_own() -> None:
    piece = _chat("x" * 100)
    memory = resume.TranscriptMemory(3 * len(piece))
    first, second = resume.Transcript(memory), resume.Transcript(memory)
    first.add(piece)
    first.add(piece)
    second.add(piece)
    assert memory.held == 3 * len(piece) and first.whole and second.whole
    second.add(piece)  # past the memory: the stream that asked lets go of all it held, the other keeps its own
    assert not second.whole and second.chunks == [] and memory.held == 2 * len(piece)
    second.add(piece)  # let go for good: its stream is not resumed, even with room again
    assert memory.held == 2 * len(piece)
    assert resume.read_back("chat", {"messages": HELLO}, second, None).blocked == resume.MEMORY_FULL
    assert resume.read_back("chat", {"messages": HELLO}, first, None).text == ["x" * 100, "x" * 100]
    first.release()
    first.release()  # the stream's end after a resume that read it back: nothing given back twice
    assert memory.held == 0
    third = resume.Transcript(memory)
    for _ in range(3):
        third.add(piece)
    assert third.whole and memory.held == 3 * len(piece)


def test_the_token_ids_the_gateway_asked_for_never_reach_the_client() -> None:
    chunk = _chat("a", ids=[7], prompt_token_ids=[1, 2, 3])
    stripped = resume.strip_token_ids(chunk)
    assert b"token_ids" not in stripped
    assert json.loads(stripped.removeprefix(b"data: "))["choices"][0]["delta"] == {"content": "a"}
    plain = _chat("no ids here")
    assert resume.strip_token_ids(plain) is plain  # unchanged, not copied


def test_where_the_clients_text_ends_among_the_ids_streamed() -> None:
    # "Hel" with one id: a whole character ends there; [12, 13] carried "lo" (13's bytes may be held back);
    # [14] carried no text: a held id, never where the client's text ends
    chunks = [_chat("", prompt_token_ids=[1]), _chat("Hel", ids=[10]), _chat("lo", ids=[11, 12, 13]),
              _chat("", ids=[14])]
    progress = _read_back("chat", {"messages": HELLO}, chunks, None)
    assert progress.generated_ids == [10, 11, 12, 13, 14]
    assert progress.shown_ends() == [4, 3, 2] and progress.boundary == 1
    assert json.loads(resume.detokenize_body(progress, 4, "served")) == {"model": "served", "tokens": [11, 12, 13]}
    progress.keep_shown(3)
    assert (progress.generated_ids, progress.generated_tokens) == ([10, 11, 12], 3)
    assert progress.shown_ends() == [3] and progress.boundary == 3  # a later break starts from here
    after_one_id = _read_back("chat", {"messages": HELLO}, [_chat("", prompt_token_ids=[1]), _chat("a", ids=[10]),
                                                            _chat("", ids=[11])], None)
    assert after_one_id.shown_ends() == [1]  # no asking: the text came with 10, none with 11


@pytest.mark.parametrize(("body", "whole"), [
    (b'{"prompt": "w0 w1"}', True), (b'{"prompt": "w0 \\ufffd"}', False), (b'{"prompt": ""}', True),
    (b'{"detail": "Not Found"}', None), (b"<html>", None), (b'{"prompt": 3}', None),
])
def test_a_detokenize_answer_says_whether_the_text_ends_on_a_whole_character(body: bytes, whole: bool | None) -> None:
    assert resume.ends_on_character(body) is whole


def test_a_deployment_error_event_ends_what_is_relayed() -> None:
    error = b'data: {"error": {"message": "engine died", "code": 500}}\n\n'
    before, failed = resume.before_error(_chat("a") + error + b"data: [DONE]\n\n")
    assert failed and before == _chat("a")
    assert resume.before_error(_chat('say "error"')) == (_chat('say "error"'), False)


def test_a_chat_stream_with_token_ids_is_read_back_exactly() -> None:
    chunks = [_chat("", prompt_token_ids=[1, 2]), _chat("Hel", ids=[10]), _chat("lo", ids=[11, 12])]
    progress = _read_back("chat", {"messages": HELLO}, chunks, None)
    assert progress.exact and progress.blocked is None
    assert (progress.prompt_ids, progress.generated_ids, progress.generated_tokens) == ([1, 2], [10, 11, 12], 3)
    assert "".join(progress.text) == "Hello" and (progress.answer_id, progress.model) == ("c1", "m")
    path, body = resume.continuation(progress, {"messages": HELLO, "temperature": 0, "top_p": 1, "n": 1,
                                                "min_tokens": 5}, "served", 40)
    sent = json.loads(body)
    assert path == "/v1/completions" and sent["prompt"] == [1, 2, 10, 11, 12] and sent["max_tokens"] == 40
    assert sent["temperature"] == 0 and sent["min_tokens"] == 2 and "n" not in sent and "messages" not in sent


def test_without_token_ids_chat_is_continued_as_its_final_assistant_message() -> None:
    progress = _read_back("chat", {"messages": HELLO}, [_chat("Hel"), _chat("lo")], None)
    assert not progress.exact
    path, body = resume.continuation(progress, {"messages": HELLO, "max_completion_tokens": 50}, "served", 30)
    sent = json.loads(body)
    assert path == "/v1/chat/completions"
    assert sent["messages"][-1] == {"role": "assistant", "content": "Hello"}
    assert sent["continue_final_message"] is True and sent["add_generation_prompt"] is False
    assert sent["max_tokens"] == 30 and "max_completion_tokens" not in sent


def test_a_request_with_tools_continues_on_the_chat_endpoint_even_with_token_ids() -> None:
    chunks = [_chat("", prompt_token_ids=[1]), _chat("Hel", ids=[10])]
    body = {"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f"}}]}
    assert not _read_back("chat", body, chunks, None).exact  # its tool parser must read the rest


@pytest.mark.parametrize(("chunks", "why"), [
    ([_chat("a"), _chat(None, finish="stop")], "already finished"),
    ([_chunk({"id": "c", "choices": [{"index": 0, "delta": {"reasoning": "hmm"}}]})], "reasoning"),
])
def test_what_cannot_be_continued_says_why(chunks: list[bytes], why: str) -> None:
    blocked = _read_back("chat", {"messages": HELLO}, chunks, None).blocked
    assert blocked is not None and why in blocked


@pytest.mark.parametrize(("api", "body", "why"), [
    ("messages", {}, "Messages API"),
    ("chat", {"n": 3}, "several choices"),
    ("chat", {"logprobs": True}, "log probabilities"),
    ("completions", {"prompt": "x", "echo": True}, "echo"),
])
def test_requests_that_can_never_be_resumed(api: str, body: dict[str, Any], why: str) -> None:
    found = resume.blocked_by_request(api, body)
    assert found is not None and why in found


def test_the_splice_speaks_under_the_first_parts_names_with_one_usage() -> None:
    progress = _read_back("chat", {"messages": HELLO}, [_chat("", prompt_token_ids=[1, 2]),
                                                             _chat("Hel", ids=[10])], None)
    progress.prompt_tokens = 2
    splice = resume.Splice(progress, client_wants_usage=True, first_part_tokens=1)
    out = splice.feed(
        _chunk({"id": "other", "object": "text_completion", "model": "sibling",
                "choices": [{"index": 0, "text": "lo", "token_ids": [11], "finish_reason": None}]})
        + _chunk({"id": "other", "choices": [{"index": 0, "text": "", "finish_reason": "stop"}]})
        + _chunk({"id": "other", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}})
        + b"data: [DONE]\n\n")
    events = [e.removeprefix(b"data: ") for e in out.split(b"\n\n") if e]
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == b"[DONE]" and splice.done
    assert {c["id"] for c in chunks} == {"c1"} and {c["model"] for c in chunks} == {"m"}
    assert chunks[0]["object"] == "chat.completion.chunk" and chunks[0]["choices"][0]["delta"] == {"content": "lo"}
    assert chunks[1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[2]["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    assert splice.usage is not None and splice.usage.prompt_tokens == 3  # the sibling's own, for its charge
    assert progress.generated_ids == [10, 11] and progress.blocked is not None  # finished: no further resume


def test_a_responses_splice_keeps_the_item_and_numbers_and_closes_over_the_whole_text() -> None:
    first = [
        sse("response.created", {"type": "response.created", "sequence_number": 0,
                                  "response": {"id": "up", "model": "m", "created_at": 3}}),
        sse("response.output_item.added", {"type": "response.output_item.added", "sequence_number": 1,
                                            "output_index": 0, "item": {"id": "msg_1", "type": "message"}}),
        sse("response.output_text.delta", {"type": "response.output_text.delta", "sequence_number": 2,
                                            "item_id": "msg_1", "output_index": 0, "content_index": 0,
                                            "delta": "Hel"}),
    ]
    progress = _read_back("responses", {"input": "hi"}, first, None)
    assert progress.item["id"] == "msg_1" and progress.sequence == 2 and progress.blocked is None
    path, body = resume.continuation(progress, {"input": "hi", "previous_response_id": "r0"}, "served", 9)
    sent = json.loads(body)
    assert path == "/v1/responses" and "previous_response_id" not in sent and sent["max_output_tokens"] == 9
    assert sent["input"] == [{"role": "user", "content": "hi"},
                             {"type": "message", "role": "assistant", "status": "incomplete",
                              "content": [{"type": "output_text", "text": "Hel"}]}]
    progress.answer_id, progress.prompt_tokens = "resp_gw", 4
    splice = resume.Splice(progress, True, 1)
    out = splice.feed(
        sse("response.created", {"type": "response.created", "sequence_number": 0, "response": {"id": "up2"}})
        + sse("response.output_item.added", {"type": "response.output_item.added", "sequence_number": 1,
                                              "item": {"id": "msg_2", "type": "message"}})
        + sse("response.output_text.delta", {"type": "response.output_text.delta", "sequence_number": 2,
                                              "item_id": "msg_2", "output_index": 0, "delta": "lo"})
        + sse("response.completed", {"type": "response.completed", "sequence_number": 3, "response": {
            "id": "up2", "output": [{"id": "msg_2", "type": "message", "content": [{"type": "output_text",
                                                                                  "text": "lo"}]}],
            "usage": {"input_tokens": 5, "output_tokens": 1}}}))
    events = [json.loads(e.split(b"\ndata: ", 1)[1]) for e in out.split(b"\n\n") if e]
    assert [e["type"] for e in events] == ["response.output_text.delta", "response.completed"]
    assert [e["sequence_number"] for e in events] == [3, 4]
    assert events[0]["item_id"] == "msg_1" and events[0]["delta"] == "lo"
    final = events[1]["response"]
    assert final["id"] == "resp_gw" and final["output"][0]["id"] == "msg_1"
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert final["usage"]["input_tokens"] == 4 and final["usage"]["output_tokens"] == 2
    assert splice.final == final and splice.done
