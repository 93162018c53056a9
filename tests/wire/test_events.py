"""The reader both agent APIs share: complete events relayed whatever the chunking, a deployment's own error
event noted, and bytes that never end an event passed on rather than held without bound."""

from __future__ import annotations

from gateway.wire import events
from gateway.wire.messages import MessagesReader
from gateway.wire.responses import ResponsesReader


def test_an_event_split_across_chunks_is_relayed_once_whole() -> None:
    reader = MessagesReader()
    event = events.sse("message_stop", {"type": "message_stop"})
    assert reader.feed(event[:10]) == b"" and not reader.done
    assert reader.feed(event[10:]) == event and reader.done


def test_the_deployments_own_error_event_is_noted_and_relayed() -> None:
    for reader, kind in ((MessagesReader(), "error"), (ResponsesReader("resp_" + "c" * 48), "error")):
        event = events.sse(kind, {"type": "error", "error": {"type": "api_error", "message": "boom"}})
        assert reader.feed(event) == event and reader.error and not reader.done


def test_bytes_that_never_end_an_event_go_on_instead_of_piling_up() -> None:
    reader = MessagesReader()
    garbage = b"x" * (events.MAX_PENDING_BYTES + 1)
    assert reader.feed(garbage) == garbage
    assert reader.feed(b"y") == b""  # a new event may start after them
