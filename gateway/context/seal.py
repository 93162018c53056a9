"""The gateway's own sealed envelope for what it hands a client to send back later (a compaction's summary):
versioned, authenticated with HMAC-SHA256 under a key from the settings, bound to the tenant it was made for.

    seal = Seal(key)
    token = seal.close({"summary": …}, tenant)        # the text a client keeps (base64url, no padding)
    seal.open(token, tenant) -> the payload            # SealError when forged, altered, another key's or tenant's

Layout (before base64url): version (1 byte) | key id (4 bytes) | payload (JSON) | HMAC-SHA256 (32 bytes) over
everything before it and the tenant's name. The payload is authenticated, not encrypted: the client may read
the summary of its own conversation, it cannot change it. The key id tells "sealed under another key"
(a rotated key, another gateway) apart from a forgery.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
from typing import Any

VERSION = 1
KEY_ID_BYTES = 4
MAC_BYTES = 32
MIN_KEY_CHARS = 32
KEY_SETTING = "AGENT_GATEWAY_COMPACTION_KEY"


class SealError(ValueError):
    """A token that does not open: why, in words a client may read (it names no key material)."""


class Seal:
    """Closes and opens tokens under one key."""

    __slots__ = ("_key", "key_id")

    def __init__(self, key: bytes) -> None:
        self._key = key
        self.key_id = hashlib.sha256(b"agent-gateway seal key id\0" + key).digest()[:KEY_ID_BYTES]

    def close(self, payload: dict[str, Any], tenant: str) -> str:
        head = bytes([VERSION]) + self.key_id + json.dumps(payload, separators=(",", ":")).encode()
        return base64.urlsafe_b64encode(head + self._mac(head, tenant)).rstrip(b"=").decode("ascii")

    def open(self, token: str, tenant: str) -> dict[str, Any]:
        raw = _decoded(token)
        if len(raw) < 1 + KEY_ID_BYTES + MAC_BYTES:
            raise SealError("it is too short to be one the gateway made")
        if raw[0] != VERSION:
            raise SealError(f"its version {raw[0]} is not one this gateway reads (it reads {VERSION})")
        head, mac = raw[:-MAC_BYTES], raw[-MAC_BYTES:]
        if head[1:1 + KEY_ID_BYTES] != self.key_id:
            raise SealError("it was sealed under another key (another gateway, or a key since rotated)")
        if not hmac.compare_digest(mac, self._mac(head, tenant)):
            raise SealError("it was altered, or made for another tenant")
        try:
            payload = json.loads(head[1 + KEY_ID_BYTES:])
        except ValueError as exc:  # authentic but unreadable: a bug of ours, said plainly
            raise SealError("its content is unreadable") from exc
        if not isinstance(payload, dict):
            raise SealError("its content is unreadable")
        return payload

    def _mac(self, head: bytes, tenant: str) -> bytes:
        return hmac.new(self._key, head + b"\0" + tenant.encode(), hashlib.sha256).digest()


def _decoded(token: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
    except (binascii.Error, ValueError) as exc:
        raise SealError("it is not base64url text the gateway made") from exc


def seal_key(configured: str, production: bool) -> tuple[bytes, str | None]:
    """The key from the settings, and a warning to log when there is none and one is made up for this process.

    In production a missing or short key is an error: a made-up key dies with the process, so every sealed
    token a client holds would stop opening at the next restart, and on every other worker or replica."""
    if configured:
        if len(configured) < MIN_KEY_CHARS:
            raise ValueError(f"{KEY_SETTING} must be at least {MIN_KEY_CHARS} characters "
                             f"(e.g. `openssl rand -hex 32`); it has {len(configured)}")
        return configured.encode(), None
    if production:
        raise ValueError(f"{KEY_SETTING} must be set in production: compaction items the gateway hands out are "
                         f"sealed with it (at least {MIN_KEY_CHARS} characters, e.g. `openssl rand -hex 32`)")
    return secrets.token_bytes(32), (
        f"{KEY_SETTING} is not set: compaction items are sealed with a key made up for this process; they will "
        "not open after a restart nor on another worker or replica. Set it (e.g. `openssl rand -hex 32`).")
