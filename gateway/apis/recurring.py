"""What an agent re-sends at every step, parsed once: its conversation so far, and its long members (tools).

    memory = Recurring(max_bytes)
    json_body.read(raw, "messages", memory)   the body, its conversation read through the memory
    memory.notes(message)                     what stages noted of a kept message (prefix.py: its own digest)

A step re-sends the step before it plus a few messages. A conversation whose bytes start with those of one the
memory holds (the step before) takes that one's parses and parses only what follows; any other is read element by
element, each element found by the XXH3-128 digest of its bytes and taken only when its bytes are equal (an edit
in the middle, a first sight). A collision costs a parse, never another message.

Kept values are shared by every body that sent their bytes, so nothing may edit one in place: the gateway's edits
build new objects (tests/server/conftest.py checks every kept value after each server test).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import msgspec
import xxhash

# An element or member this long is kept by its bytes (an agent's tool call is a few hundred bytes; a shorter one
# is parsed faster than it is found).
MIN_KEPT = 128
# A conversation is found by the digest of its first bytes, at the longest of these lengths it holds: sessions of
# one agent share a system prompt of 10-30 KB, so the longer lengths tell them apart.
HEAD_LENGTHS = (1 << 20, 256 << 10, 64 << 10, 16 << 10, 4 << 10)
CANDIDATES = 8  # conversations kept under one head's digest at most (the newest)

_VALUE = msgspec.json.Decoder()
_ELEMENTS = msgspec.json.Decoder(list[msgspec.Raw])
_WHITESPACE = b" \t\r\n"


class Recurring:
    """Conversations and long members of request bodies, kept parsed by their bytes, with what stages noted of
    each kept value: at most `max_bytes` of elements and as many of conversations, the least recently sent
    dropped first (0: nothing is kept)."""

    __slots__ = ("_by_digest", "_by_head", "_by_id", "_conversations", "conversation_bytes", "kept_bytes",
                 "max_bytes")

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.kept_bytes = self.conversation_bytes = 0
        self._by_digest: OrderedDict[int, _Kept] = OrderedDict()
        self._by_id: dict[int, _Kept] = {}  # id(value): a value the memory holds (so its id is unique)
        self._conversations: OrderedDict[int, _Conversation] = OrderedDict()  # by id, least recently sent first
        self._by_head: dict[int, list[_Conversation]] = {}  # digest of a head -> its conversations, newest first

    def elements(self, array: msgspec.Raw) -> Any:
        """An array member's value: what a kept conversation it continues holds, then each element its kept parse
        where there is one; any other JSON as parsed (for the body's check to name)."""
        data = bytes(array)  # a copy: `array` is a view of the whole body
        if self.max_bytes <= 0:
            return _VALUE.decode(data)
        continued = self._continued(data)
        if continued is None:
            try:
                raws = _ELEMENTS.decode(data)
            except msgspec.ValidationError:  # not an array
                return _VALUE.decode(data)
            values = tuple(map(self.member, raws))
        else:
            earlier, raws = continued
            values = earlier.values + tuple(map(self.member, raws))
            self._drop_conversation(earlier)  # its session moved on: this one stands for it now
        self._keep_conversation(_Conversation(data[:-1].rstrip(_WHITESPACE), values))
        return list(values)  # the body's own list: a stage may build a new body on it

    def member(self, raw: msgspec.Raw) -> Any:
        """The value of `raw`: kept, when it is long enough to recur as a dict or list."""
        if len(raw) < MIN_KEPT or self.max_bytes <= 0:
            return _VALUE.decode(raw)
        digest = xxhash.xxh3_128_intdigest(raw)
        kept = self._by_digest.get(digest)
        if kept is not None and kept.raw == raw:
            self._by_digest.move_to_end(digest)
            return kept.value
        value = _VALUE.decode(raw)
        if kept is None and isinstance(value, (dict, list)):
            self._keep(digest, _Kept(msgspec.Raw(bytes(raw)), value))  # a copy: `raw` is a view of the whole body
        return value

    def notes(self, value: Any) -> dict[str, Any] | None:
        """What stages noted of `value` while the memory holds it (a dict to add to), else None."""
        kept = self._by_id.get(id(value))
        if kept is None or kept.value is not value:
            return None
        if kept.notes is None:
            kept.notes = {}
        return kept.notes

    def __len__(self) -> int:
        return len(self._by_digest)

    def kept(self) -> Iterator[tuple[bytes, Any]]:
        """Each kept value with its bytes: the elements, then the conversations (as lists)."""
        yield from ((bytes(kept.raw), kept.value) for kept in self._by_digest.values())
        yield from ((c.head + b"]", list(c.values)) for c in self._conversations.values())

    def _continued(self, data: bytes) -> tuple[_Conversation, list[msgspec.Raw]] | None:
        """The kept conversation `data` continues, and the raw elements it adds; None when it continues none."""
        view = memoryview(data)
        for length in HEAD_LENGTHS:
            if length >= len(data):
                continue
            for earlier in self._by_head.get(xxhash.xxh3_64_intdigest(view[:length]), ()):
                if not data.startswith(earlier.head):
                    continue
                rest = data[len(earlier.head):].lstrip(_WHITESPACE)
                if rest[:1] == b"]":
                    return earlier, []
                if rest[:1] == b",":
                    try:
                        return earlier, _ELEMENTS.decode(b"[" + rest[1:])
                    except msgspec.DecodeError:
                        return None
        return None

    def _keep_conversation(self, conversation: _Conversation) -> None:
        head = conversation.head
        length = next((n for n in HEAD_LENGTHS if n <= len(head)), None)
        if length is None or len(head) > self.max_bytes:  # too short to be found: parsed whole at no cost
            return
        conversation.key = xxhash.xxh3_64_intdigest(memoryview(head)[:length])
        bucket = self._by_head.setdefault(conversation.key, [])
        bucket.insert(0, conversation)
        if len(bucket) > CANDIDATES:
            self._drop_conversation(bucket[-1])
        self._conversations[id(conversation)] = conversation
        self.conversation_bytes += len(head)
        while self.conversation_bytes > self.max_bytes:
            self._drop_conversation(next(iter(self._conversations.values())))

    def _drop_conversation(self, conversation: _Conversation) -> None:
        if self._conversations.pop(id(conversation), None) is None:
            return
        self.conversation_bytes -= len(conversation.head)
        bucket = self._by_head[conversation.key]
        bucket.remove(conversation)
        if not bucket:
            del self._by_head[conversation.key]

    def _keep(self, digest: int, kept: _Kept) -> None:
        size = len(kept.raw)
        if size > self.max_bytes:
            return
        self._by_digest[digest] = kept
        self._by_id[id(kept.value)] = kept
        self.kept_bytes += size
        while self.kept_bytes > self.max_bytes:
            _, dropped = self._by_digest.popitem(last=False)
            del self._by_id[id(dropped.value)]
            self.kept_bytes -= len(dropped.raw)


class _Kept:
    __slots__ = ("notes", "raw", "value")

    def __init__(self, raw: msgspec.Raw, value: Any) -> None:
        self.raw, self.value = raw, value
        self.notes: dict[str, Any] | None = None


class _Conversation:
    """An array as sent, without its closing bracket (and the whitespace before it), and its elements' values."""

    __slots__ = ("head", "key", "values")

    def __init__(self, head: bytes, values: tuple[Any, ...]) -> None:
        self.head, self.values = head, values
        self.key = 0  # the digest of its head it is found by
