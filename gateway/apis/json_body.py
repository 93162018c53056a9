"""Request and answer bodies as JSON: lenient reading with errors that say what was wrong, compact writing, and
re-encoding an edited body from the bytes it was sent as."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from typing import Any

import msgspec
import pydantic_core

from gateway.apis.recurring import MEMBERS, Conversation, Recurring
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


_MEMBERS = MEMBERS  # one decoder of a body's members as sent: recurring.py's
_RAW_ENCODER = msgspec.json.Encoder()
_ABSENT = object()
# Below this a body is parsed whole: one parse costs less than the scans that find what recurs.
RECURRING_MIN_BODY = 16 * 1024


def read(raw: bytes, repeated: str | None = None, recurring: Recurring | None = None) -> Source:
    """A request body parsed (`decode`'s verdicts and errors), with its bytes. With `recurring`, a long body's
    array member `repeated` (its conversation) and its long members are read through that memory
    (gateway/apis/recurring.py): an agent re-sends its whole conversation at each step, so only the step's new
    messages are parsed."""
    if recurring is not None and repeated is not None and len(raw) >= RECURRING_MIN_BODY:
        with contextlib.suppress(msgspec.DecodeError, RecursionError):  # decode's path says what was wrong
            return Source(raw, *recurring.body(raw, repeated), recurring)
    return Source(raw, decode(raw))


class Source:
    """A request body's bytes and the object they parse to, and what of the object reads as its bytes as sent.

    The parse is never edited in place (the gateway's edits build new objects), so a member that is still the
    parse's own object still reads as the bytes it came from: the deployment is sent those bytes, and the
    tools' text is kept by them, without encoding them again. `recurring`: the memory the body's conversation
    was read through, if any (what other stages noted of its messages)."""

    __slots__ = ("_members", "body", "conversation", "raw", "recurring")

    def __init__(self, raw: bytes, body: dict[str, Any], members: dict[str, msgspec.Raw] | None = None,
                 conversation: Conversation | None = None, recurring: Recurring | None = None) -> None:
        self.raw, self.body, self.recurring = raw, body, recurring
        self.conversation = conversation  # the body's conversation as the memory keeps it (what stages note of it)
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
