"""The reader both agent APIs share: complete events relayed whatever the chunking, a deployment's own error
event noted, and bytes that never end an event passed on rather than held without bound."""

from __future__ import annotations

from gateway.apis import events
from gateway.apis.messages.wire import MessagesReader
from gateway.apis.responses.wire import ResponsesReader


def test_an_event_split_across_chunks_is_relayed_once_whole() -> None:
    reader = MessagesReader()
    event = events.sse("message_stop", {"type": "message_stop"})
    assert reader.feed(event[:10]) == b"" and not reader.done
    assert reader.feed(event[10:]) == event and reader.done


def test_the_deployments_own_error_event_is_noted_and_relayed_by_responses_withheld_by_messages() -> None:
    """vLLM's Messages error event names types Anthropic's clients do not know ("internal_error"): the relay ends
    that stream with the gateway's own event instead; a Responses one is followed by its response.failed."""
    event = events.sse("error", {"type": "error", "error": {"type": "internal_error", "message": "boom"}})
    responses = ResponsesReader("resp_" + "c" * 48)
    assert responses.feed(event) == event and responses.error and not responses.done
    messages = MessagesReader()
    delta = events.sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                               "delta": {"type": "text_delta", "text": "hi"}})
    assert messages.feed(delta + event[:7]) == delta
    assert messages.feed(event[7:] + events.sse("message_stop", {})) == b"" and messages.error
    assert messages.feed(delta) == b"" and not messages.done


def test_bytes_that_never_end_an_event_go_on_instead_of_piling_up() -> None:
    reader = MessagesReader()
    garbage = b"x" * (events.MAX_PENDING_BYTES + 1)
    assert reader.feed(garbage) == garbage
    assert reader.feed(b"y") == b""  # a new event may start after them
