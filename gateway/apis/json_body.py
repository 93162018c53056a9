"""Request and answer bodies as JSON: lenient reading with errors that say what was wrong, compact writing, and
re-encoding an edited body from the bytes it was sent as."""

from __future__ import annotations

import contextlib
import json
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import msgspec
import pydantic_core
import xxhash

from gateway.errors import BadRequest

_BODY = msgspec.json.Decoder()


def decode(raw: bytes) -> dict[str, Any]:
    """Parse a request body; anything but a JSON object is a 400 that says what was wrong.

    msgspec's parser is the fastest of the parsers at hand (about half of json.loads' time, four fifths of
    pydantic's, on an agent's 100-200 KB step); whatever it refuses gets a second parse by json, whose verdict
    stands: its error messages, and its leniency (NaN, a number out of range, a lone surrogate escape).
    """
    try:
        body = _BODY.decode(raw)
    except (msgspec.DecodeError, RecursionError):  # too deep for its stack: json says so in its words
        body = _decode_strictly(raw)
    if not isinstance(body, dict):
        raise BadRequest(f"The request body must be a JSON object, got {type(body).__name__}")
    return body


def _decode_strictly(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except UnicodeDecodeError as exc:
        raise BadRequest("The request body is not valid UTF-8") from exc
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}"
        raise BadRequest(f"The request body is not valid JSON: {exc.msg} at {where}") from exc
    except RecursionError as exc:
        raise BadRequest("The request body nests arrays or objects too deeply") from exc


def expect(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], *, required: bool = False) -> Any:
    """The field's value when it has the wanted JSON type (None when absent); else a 400 naming the field."""
    value = body.get(name)
    if value is None:
        if required:
            raise BadRequest(f"Missing required parameter: '{name}'", param=name, code="missing_required_parameter")
        return None
    # bool is an int in Python; a JSON true is never a valid count.
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        wanted = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise BadRequest(
            f"Invalid type for '{name}': expected {_json_type(wanted)}, got {_json_type(type(value).__name__)}",
            param=name,
            code="invalid_type",
        )
    return value


def _json_type(py: str) -> str:
    names = {"str": "a string", "list": "an array", "dict": "an object", "int": "an integer",
             "float": "a number", "bool": "a boolean"}
    return " or ".join(names.get(part, part) for part in py.split(" or "))


# json.dumps with separators builds a new encoder per call; one shared encoder skips that on the hot path.
_COMPACT = json.JSONEncoder(separators=(",", ":"))


def encode(value: Any) -> bytes:
    """Compact JSON: pydantic's Rust encoder (about 4x json's speed), or json for what it cannot write
    (a lone surrogate in a string, which json.loads accepts). NaN and Infinity stay as json writes them."""
    try:
        return pydantic_core.to_json(value, inf_nan_mode="constants")
    except pydantic_core.PydanticSerializationError:
        return _COMPACT.encode(value).encode()


# A body's top-level members as the bytes they were sent as: msgspec skips over each value without building it.
_MEMBERS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ELEMENTS = msgspec.json.Decoder(list[msgspec.Raw])
_RAW_ENCODER = msgspec.json.Encoder()
_ABSENT = object()
# Below this a body is parsed whole: one parse costs less than the scans that find what recurs.
RECURRING_MIN_BODY = 16 * 1024
# An element or member this long is kept by its bytes (an agent's tool call is a few hundred bytes; shorter is
# parsed faster than it is found).
RECURRING_MIN_MEMBER = 128


def read(raw: bytes, repeated: str | None = None, recurring: Recurring | None = None) -> Source:
    """A request body parsed (`decode`'s verdicts and errors), with its bytes. With `recurring`, a long body's
    array member `repeated` (a conversation) is read element by element, and each element the memory has seen
    before, byte for byte, is its earlier parse: an agent re-sends its whole conversation at each step, so only
    the step's new messages are parsed."""
    if recurring is not None and repeated is not None and len(raw) >= RECURRING_MIN_BODY:
        with contextlib.suppress(msgspec.DecodeError, RecursionError):  # decode's path says what was wrong
            members = _MEMBERS.decode(raw)
            body = {name: recurring.elements(value) if name == repeated else recurring.member(value)
                    for name, value in members.items()}
            return Source(raw, body, members, recurring)
    return Source(raw, decode(raw))


class Recurring:
    """Conversation elements and long members of request bodies, kept parsed by their bytes (at most `max_bytes`
    of them, the least recently sent dropped first), with what other stages noted of each.

    A kept value is shared by every body that sent its bytes, so it must never be edited in place: the gateway's
    edits build new objects (tests/apis/test_recurring.py holds the pipeline to that). An entry is found by the
    XXH3-128 digest of its bytes and taken only when its bytes are equal, so a collision costs a parse."""

    __slots__ = ("_by_digest", "_by_id", "kept_bytes", "max_bytes")

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.kept_bytes = 0
        self._by_digest: OrderedDict[int, _Kept] = OrderedDict()
        self._by_id: dict[int, _Kept] = {}  # id(value): what was noted of a value the memory holds (so ids are unique)

    def elements(self, array: msgspec.Raw) -> Any:
        """An array member's value, each element its kept parse where there is one; any other JSON as parsed."""
        try:
            elements = _ELEMENTS.decode(array)
        except msgspec.ValidationError:  # not an array: parsed as it is, for the body's check to name
            return _VALUE.decode(array)
        return [self.member(element) for element in elements]

    def member(self, raw: msgspec.Raw) -> Any:
        """The value of `raw`: kept, when it is long enough to recur as a dict or list."""
        if len(raw) < RECURRING_MIN_MEMBER or self.max_bytes <= 0:
            return _VALUE.decode(raw)
        digest = xxhash.xxh3_128_intdigest(raw)
        kept = self._by_digest.get(digest)
        if kept is not None and kept.raw == raw:
            self._by_digest.move_to_end(digest)
            return kept.value
        value = _VALUE.decode(raw)
        if kept is None and isinstance(value, (dict, list)):
            self._keep(digest, _Kept(msgspec.Raw(bytes(raw)), value))  # a copy: `raw` holds the whole body
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
        """Each kept value with its bytes, the least recently sent first."""
        return ((bytes(kept.raw), kept.value) for kept in self._by_digest.values())

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


_VALUE = msgspec.json.Decoder()


class Source:
    """A request body's bytes and the object they parse to, and what of the object reads as its bytes as sent.

    The parse is never edited in place (the gateway's edits build new objects), so a member that is still the
    parse's own object still reads as the bytes it came from: the deployment is sent those bytes, and the
    tools' text is kept by them, without encoding them again. `recurring`: the memory the body's conversation
    was read through, if any (what other stages noted of its messages)."""

    __slots__ = ("_members", "body", "raw", "recurring")

    def __init__(self, raw: bytes, body: dict[str, Any], members: dict[str, msgspec.Raw] | None = None,
                 recurring: Recurring | None = None) -> None:
        self.raw, self.body, self.recurring = raw, body, recurring
        self._members: dict[str, msgspec.Raw] | object | None = _ABSENT if members is None else members

    def members(self) -> dict[str, msgspec.Raw] | None:
        """The body's top-level members as sent (one scan of its bytes, done once); None when the scan refuses
        the bytes (NaN, a lone surrogate escape) or reads other members than the body holds (a repeated key, a
        member set after the parse)."""
        if self._members is _ABSENT:
            try:
                self._members = _MEMBERS.decode(self.raw)
            except (msgspec.DecodeError, RecursionError):
                self._members = None
        members = self._members
        return members if isinstance(members, dict) and members.keys() == self.body.keys() else None

    def member_as_sent(self, name: str, value: Any) -> memoryview | None:
        """The member `name`'s bytes as sent (a view, not a copy) when `value` is still its parse; else None."""
        members = self.members()
        if members is None or name not in members or self.body.get(name, _ABSENT) is not value:
            return None
        return memoryview(members[name])


def encode_edited(out: Mapping[str, Any], source: Source | None) -> bytes:
    """`out`, a copy of the body `source` was parsed into with top-level members set, added or dropped, as JSON.
    The members `out` holds as parsed are copied from the request's bytes as sent and only the others are
    encoded: an agent's 100-200 KB body costs one scan of its bytes, not an encode of every message. A body the
    scan refuses (NaN, a lone surrogate escape) or reads otherwise is encoded whole."""
    if source is None or (members := source.members()) is None:
        return encode(out)
    parsed = source.body
    edited = {name: members[name] if parsed.get(name, _ABSENT) is value else msgspec.Raw(encode(value))
              for name, value in out.items()}
    return _RAW_ENCODER.encode(edited)


def response_object(raw: bytes) -> dict[str, Any] | None:
    """A deployment's JSON answer as an object; None when it is anything else (HTML, garbage, an array)."""
    try:
        found = pydantic_core.from_json(raw)
    except ValueError:
        return None
    return found if isinstance(found, dict) else None
