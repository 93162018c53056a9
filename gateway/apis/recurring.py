"""What an agent re-sends at every step, parsed once: its conversation so far, and its long members (tools).

    memory = Recurring(max_bytes)
    json_body.read(raw, "messages", memory)   the body, its conversation read through the memory
    memory.notes(message)                     what stages noted of a kept message (prefix.py: its own digest)
    resume(conversation, messages, key)       what a stage noted under `key` of the step this one continues, where
                                              to go on from, and where to note this step's (the features, the
                                              prompt's chain, the body's check: a step costs them its new messages)

A step re-sends the step before it plus a few messages. A body that is the step before's bytes with messages added
at its conversation's end (every other member's bytes the same) is not scanned: its members are where they were,
and only the added messages are parsed. Else the body's members are scanned, and a conversation whose bytes start
with those of one the memory holds (the step before) takes that one's parses and parses only what follows; any
other is read element by element, each element found by the XXH3-128 digest of its bytes and taken only when its
bytes are equal (an edit in the middle, a first sight). A collision costs a parse, never another message.

Kept values are shared by every body that sent their bytes, so nothing may edit one in place: the gateway's edits
build new objects (tests/server/conftest.py checks every kept value after each server test).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
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
# A body's top-level members as the bytes they were sent as: msgspec skips over each value without building it.
MEMBERS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_WHITESPACE = b" \t\r\n"
_PARSE = object()  # a framed member that is parsed at each step (one too short for the memory to keep)
_COMMA = ord(",")


class Recurring:
    """Conversations and long members of request bodies, kept parsed by their bytes, with what stages noted of
    each kept value: at most `max_bytes` of elements and as many of conversations, the least recently sent
    dropped first (0: nothing is kept). The bound counts bytes as sent; what stages note beside them is not
    counted (a conversation's notes are ~100 bytes a message, most of it the prompt chain's link digests)."""

    __slots__ = ("_by_digest", "_by_front", "_by_head", "_by_id", "_conversations", "conversation_bytes",
                 "kept_bytes", "max_bytes")

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.kept_bytes = self.conversation_bytes = 0
        self._by_digest: OrderedDict[int, _Kept] = OrderedDict()
        self._by_id: dict[int, _Kept] = {}  # id(value): a value the memory holds (so its id is unique)
        self._conversations: OrderedDict[int, Conversation] = OrderedDict()  # by id, least recently sent first
        self._by_head: dict[int, list[Conversation]] = {}  # digest of a head -> its conversations, newest first
        self._by_front: dict[int, list[Conversation]] = {}  # digest of a body's first bytes -> its framed ones

    def body(self, raw: bytes, repeated: str) -> tuple[dict[str, Any], dict[str, msgspec.Raw], Conversation | None]:
        """A JSON object's values, its array member `repeated` read through the memory, each member's bytes as
        sent, and the conversation the memory keeps for `repeated` (None: none kept). msgspec's errors are raised
        as its decoders raise them (the caller's other parse names them)."""
        found = self._body_continued(raw, repeated) if self.max_bytes > 0 else None
        if found is not None:
            return found
        members = MEMBERS.decode(raw)
        body: dict[str, Any] = {}
        conversation = None
        for name, value in members.items():
            if name == repeated:
                body[name], conversation = self._elements(value)
            else:
                body[name] = self.member(value)
        if conversation is not None and conversation.values:
            self._frame(raw, members, body, repeated, conversation)
        return body, members, conversation

    def elements(self, array: msgspec.Raw) -> Any:
        """An array member's value: what a kept conversation it continues holds, then each element its kept parse
        where there is one; any other JSON as parsed (for the body's check to name)."""
        return self._elements(array)[0]

    def _elements(self, array: msgspec.Raw) -> tuple[Any, Conversation | None]:
        """elements(), and the conversation the memory now keeps for it (None: none kept)."""
        data = bytes(array)  # a copy: `array` is a view of the whole body
        if self.max_bytes <= 0:
            return _VALUE.decode(data), None
        continued = self._continued(data)
        earlier: Conversation | None = None
        if continued is None:
            try:
                raws = _ELEMENTS.decode(data)
            except msgspec.ValidationError:  # not an array
                return _VALUE.decode(data), None
            values = tuple(map(self.member, raws))
        else:
            earlier, raws = continued
            values = earlier.values + tuple(map(self.member, raws))
            self._drop_conversation(earlier)  # its session moved on: this one stands for it now
        conversation = Conversation(data[:-1].rstrip(_WHITESPACE), values, earlier)
        kept = self._keep_conversation(conversation, earlier)
        return list(values), conversation if kept else None  # the body's own list: a stage may build on it

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
            self._keep(digest, _Kept(msgspec.Raw(bytes(raw)), value, digest))  # a copy: `raw` views the whole body
        return value

    def notes(self, value: Any) -> dict[str, Any] | None:
        """What stages noted of `value` while the memory holds it (a dict to add to), else None."""
        kept = self._kept(value)
        if kept is None:
            return None
        if kept.notes is None:
            kept.notes = {}
        return kept.notes

    def _kept(self, value: Any) -> _Kept | None:
        """The memory's entry of `value`, while it holds that very object."""
        kept = self._by_id.get(id(value))
        return kept if kept is not None and kept.value is value else None

    def _touch(self, value: Any) -> None:
        """A kept value sent again: the most recently sent now (as `member` finding it would have made it)."""
        kept = self._kept(value)
        if kept is not None:
            self._by_digest.move_to_end(kept.digest)

    def __len__(self) -> int:
        return len(self._by_digest)

    def kept(self) -> Iterator[tuple[bytes, Any]]:
        """Each kept value with its bytes: the elements, then the conversations (as lists)."""
        yield from ((bytes(kept.raw), kept.value) for kept in self._by_digest.values())
        yield from ((bytes(c.head) + b"]", list(c.values)) for c in self._conversations.values())

    def _continued(self, data: bytes) -> tuple[Conversation, list[msgspec.Raw]] | None:
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

    def _body_continued(self, raw: bytes,
                        repeated: str) -> tuple[dict[str, Any], dict[str, msgspec.Raw], Conversation | None] | None:
        """body() of a body that is a kept one's bytes with elements added at the end of its conversation (the
        step before, plus this step's messages), without scanning it; None when it is not one."""
        view = memoryview(raw)
        for length in HEAD_LENGTHS:
            if length >= len(raw):
                continue
            front_key = xxhash.xxh3_64_intdigest(view[:length])
            for earlier in self._by_front.get(front_key, ()):
                frame = earlier.frame
                if frame is None or frame.repeated != repeated:
                    continue
                front, head, back = frame.front, earlier.head, frame.back
                added_at, end = len(front) + len(head), len(raw) - len(back)
                if end < added_at or not (raw.startswith(front) and raw.startswith(head, len(front))
                                          and raw.endswith(back)):
                    continue
                added = _added(raw[added_at:end])
                if added is None:
                    return None
                values = earlier.values + tuple(map(self.member, added))
                self._drop_conversation(earlier)  # its session moved on: this one stands for it now
                # Views of this body, not copies: it is all the memory keeps of its session (the step before's
                # bytes are let go with it).
                conversation = Conversation(view[len(front):_before_whitespace(raw, end)], values, earlier)
                frame = _Frame(view[:len(front)], view[end:], frame.places, repeated, frame.values)
                kept = self._keep_conversation(conversation, earlier)
                if kept:
                    self._attach(conversation, frame, view, (length, front_key))
                return *frame.read(view, list(values), self.member, self._touch), conversation if kept else None
        return None

    def _frame(self, raw: bytes, members: dict[str, msgspec.Raw], body: dict[str, Any], repeated: str,
               conversation: Conversation) -> None:
        """Keep where `raw`'s members sit around its conversation, for its next step to be read without a scan."""
        places = _places(raw, members)
        if places is None:  # a member's key written otherwise than msgspec writes it, or one sent twice
            return
        start, end = places[repeated]
        size, view = len(raw), memoryview(raw)
        self._attach(conversation, _Frame(view[:start], view[end - 1:], tuple(
            (name, at, to) if at <= start else (name, at - size, to - size) for name, (at, to) in places.items()),
            repeated, tuple(body[name] if self._kept(body[name]) else _PARSE for name in places)), view)

    def _attach(self, conversation: Conversation, frame: _Frame, body: memoryview,
                hashed: tuple[int, int] | None = None) -> None:
        """Give a kept conversation the frame of the body it came in (its bytes counted with the conversation's),
        found by the digest of the body's first bytes (its front, then the conversation); `hashed`: a length and
        the digest of the body's bytes up to it, already taken (the lookup that found the step before)."""
        length = next((n for n in HEAD_LENGTHS if n <= len(frame.front) + len(conversation.head)), None)
        if length is None or id(conversation) not in self._conversations:
            return
        conversation.frame = frame
        if hashed is not None and hashed[0] == length:
            conversation.front_key = hashed[1]
        else:
            conversation.front_key = xxhash.xxh3_64_intdigest(body[:length])
        self.conversation_bytes += frame.size
        bucket = self._by_front.setdefault(conversation.front_key, [])
        bucket.insert(0, conversation)
        if len(bucket) > CANDIDATES:
            self._drop_conversation(bucket[-1])
        self._shrink()

    def _keep_conversation(self, conversation: Conversation, earlier: Conversation | None = None) -> bool:
        """Keep it, the least recently sent dropped past the bound; whether it is kept. `earlier`: the kept one whose
        bytes its head starts with (the step before), whose digest of its first bytes serves when it has them all."""
        head = conversation.head
        length = next((n for n in HEAD_LENGTHS if n <= len(head)), None)
        if length is None or len(head) > self.max_bytes:  # too short to be found: parsed whole at no cost
            return False
        if earlier is not None and len(earlier.head) >= length:  # its digest was taken at the longest length it
            conversation.key = earlier.key                          # holds, which is this one then
        else:
            conversation.key = xxhash.xxh3_64_intdigest(memoryview(head)[:length])
        bucket = self._by_head.setdefault(conversation.key, [])
        bucket.insert(0, conversation)
        if len(bucket) > CANDIDATES:
            self._drop_conversation(bucket[-1])
        self._conversations[id(conversation)] = conversation
        self.conversation_bytes += len(head)
        self._shrink()
        return id(conversation) in self._conversations

    def _shrink(self) -> None:
        while self.conversation_bytes > self.max_bytes:
            self._drop_conversation(next(iter(self._conversations.values())))

    def _drop_conversation(self, conversation: Conversation) -> None:
        if self._conversations.pop(id(conversation), None) is None:
            return
        self.conversation_bytes -= len(conversation.head)
        bucket = self._by_head[conversation.key]
        bucket.remove(conversation)
        if not bucket:
            del self._by_head[conversation.key]
        if conversation.frame is not None:
            self.conversation_bytes -= conversation.frame.size
            framed = self._by_front[conversation.front_key]
            framed.remove(conversation)
            if not framed:
                del self._by_front[conversation.front_key]

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
    __slots__ = ("digest", "notes", "raw", "value")

    def __init__(self, raw: msgspec.Raw, value: Any, digest: int) -> None:
        self.raw, self.value, self.digest = raw, value, digest
        self.notes: dict[str, Any] | None = None


class Conversation:
    """An array as sent, without its closing bracket (and the whitespace before it), and its elements' values; with
    the frame of the body it came in, when that body's next step may be read without a scan, and what stages noted
    of it and of the conversation it continues."""

    __slots__ = ("earlier_length", "earlier_notes", "frame", "front_key", "head", "key", "notes", "values")

    def __init__(self, head: bytes | memoryview, values: tuple[Any, ...], earlier: Conversation | None = None) -> None:
        self.head, self.values = head, values
        self.key = 0  # the digest of its head it is found by
        self.frame: _Frame | None = None
        self.front_key = 0  # the digest of its body's first bytes it is found by, with a frame
        self.notes: dict[str, Any] = {}
        # What was noted of the conversation this one continues (its first `earlier_length` values): only that is
        # kept of it, not its values.
        self.earlier_notes = earlier.notes if earlier is not None else None
        self.earlier_length = len(earlier.values) if earlier is not None else 0


class _Frame:
    """A body around its conversation: the bytes before the conversation (`front`), those from its closing bracket
    to the body's end (`back`), and where each member's bytes sit (offsets from the body's start for a member
    before the conversation, negative ones from its end for one after it)."""

    __slots__ = ("back", "front", "places", "repeated", "values")

    def __init__(self, front: memoryview, back: memoryview, places: tuple[tuple[str, int, int], ...],
                 repeated: str, values: tuple[Any, ...]) -> None:
        self.front, self.back, self.places, self.repeated = front, back, places, repeated
        # Each member's kept value, where the memory kept it (long), else _PARSE: a body whose front and back are
        # this frame's bytes sends the same bytes for each, so a kept one is neither hashed nor compared again.
        self.values = values

    @property
    def size(self) -> int:
        return len(self.front) + len(self.back)

    def read(self, view: memoryview, conversation: list[Any], member: Callable[[msgspec.Raw], Any],
             touch: Callable[[Any], None]) -> tuple[dict[str, Any], dict[str, msgspec.Raw]]:
        """The body's values and members' bytes, each member where the frame puts it (the conversation's end moved
        with what was added); a kept member's value as the frame holds it (`touch`ed as sent again), any other
        parsed again, never shared."""
        repeated = self.repeated
        body: dict[str, Any] = {}
        members: dict[str, msgspec.Raw] = {}
        size = len(view)
        for (name, at, to), kept in zip(self.places, self.values, strict=True):
            if name == repeated:
                members[name] = msgspec.Raw(view[at:size - len(self.back) + 1])
                body[name] = conversation
                continue
            # an offset below 0 counts from the body's end
            members[name] = raw = msgspec.Raw(view[at + size if at < 0 else at:to + size if to < 0 else to])
            if kept is _PARSE:
                body[name] = member(raw)
            else:
                touch(kept)
                body[name] = kept
        return body, members


def _added(rest: bytes) -> list[msgspec.Raw] | None:
    """The elements that `rest` (what follows a kept conversation's last element, before its closing bracket)
    adds: [] for none; None when it is not a comma and elements."""
    rest = rest.strip(_WHITESPACE)
    if not rest:
        return []
    if rest[0] != _COMMA:
        return None
    try:
        return _ELEMENTS.decode(b"[" + rest[1:] + b"]")
    except msgspec.DecodeError:
        return None


def _places(raw: bytes, members: dict[str, msgspec.Raw]) -> dict[str, tuple[int, int]] | None:
    """Where each member's value sits in `raw`, read from its start: each key as msgspec writes it, each value the
    bytes the scan gave; None when the object is written otherwise (an escaped key, a key sent twice)."""
    at = _past_whitespace(raw, 0)
    if raw[at:at + 1] != b"{":
        return None
    places: dict[str, tuple[int, int]] = {}
    for index, (name, value) in enumerate(members.items()):
        at = _past_whitespace(raw, at + 1 if index == 0 else at)
        if index:
            if raw[at:at + 1] != b",":
                return None
            at = _past_whitespace(raw, at + 1)
        key = _KEY.encode(name)
        if not raw.startswith(key, at):
            return None
        at = _past_whitespace(raw, at + len(key))
        if raw[at:at + 1] != b":":
            return None
        at = _past_whitespace(raw, at + 1)
        if not raw.startswith(value, at):
            return None
        places[name] = (at, at + len(value))
        at += len(value)
    at = _past_whitespace(raw, at if members else at + 1)
    return places if raw[at:at + 1] == b"}" and _past_whitespace(raw, at + 1) == len(raw) else None


def _before_whitespace(raw: bytes, end: int) -> int:
    while end > 0 and raw[end - 1] in _WHITESPACE:
        end -= 1
    return end


def _past_whitespace(raw: bytes, at: int) -> int:
    while at < len(raw) and raw[at] in _WHITESPACE:
        at += 1
    return at


_KEY = msgspec.json.Encoder()


def resume(conversation: Conversation | None, elements: Any, key: str) -> tuple[Any, int, dict[str, Any] | None]:
    """For a stage that tallies a conversation element by element, when `elements` are the values of the
    conversation the memory keeps for them: what the stage noted under `key` of the conversation this one continues
    (None: nothing), how many of the first elements that note covers (0 without one), and where to note this one's
    tally for the step that continues it. (None, 0, None) when `elements` are others (a view the gateway built, an
    edit): the stage walks them whole and notes nothing. Equal values give equal tallies, so a note must be a
    function of the values alone."""
    if conversation is None:
        return None, 0, None
    values = conversation.values
    if type(elements) is not list or len(elements) != len(values) or elements != list(values):
        return None, 0, None
    earlier = conversation.earlier_notes.get(key) if conversation.earlier_notes is not None else None
    return earlier, conversation.earlier_length if earlier is not None else 0, conversation.notes
