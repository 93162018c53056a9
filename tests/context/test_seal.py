"""The gateway's sealed envelope: opens only unchanged, under its key, for its tenant; the key's rules."""

from __future__ import annotations

import base64

import pytest

from gateway.context.seal import Seal, SealError, seal_key

KEY = b"k" * 40


def _flip(token: str, at: int) -> str:
    raw = bytearray(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
    raw[at] ^= 1
    return base64.urlsafe_b64encode(bytes(raw)).rstrip(b"=").decode()


def test_a_sealed_payload_opens_as_it_was() -> None:
    token = Seal(KEY).close({"summary": "s", "before": 3}, "acme")
    assert Seal(KEY).open(token, "acme") == {"summary": "s", "before": 3}


@pytest.mark.parametrize(("token", "reason"), [
    (lambda t: _flip(t, 10), "altered"),  # a byte of the payload
    (lambda t: _flip(t, -1), "altered"),  # a byte of the MAC
    (lambda t: _flip(t, 0), "version"),
    (lambda t: Seal(b"z" * 40).close({"summary": "s"}, "acme"), "another key"),
    (lambda t: "gAAAAABpM0Yj", "too short"),
    (lambda t: "not base64 at all!!", "base64url"),
])
def test_anything_else_does_not_open_and_says_why(token: object, reason: str) -> None:
    sealed = Seal(KEY).close({"summary": "s"}, "acme")
    with pytest.raises(SealError, match=reason):
        Seal(KEY).open(token(sealed), "acme")  # type: ignore[operator]


def test_a_token_opens_for_its_tenant_only() -> None:
    with pytest.raises(SealError, match="another tenant"):
        Seal(KEY).open(Seal(KEY).close({"summary": "s"}, "acme"), "globex")


def test_the_key_comes_from_the_settings_is_required_in_production_and_made_up_in_development() -> None:
    assert seal_key("s" * 32, production=True) == (b"s" * 32, None)
    with pytest.raises(ValueError, match="must be set in production"):
        seal_key("", production=True)
    with pytest.raises(ValueError, match="at least 32 characters"):
        seal_key("short", production=False)
    made, warning = seal_key("", production=False)
    assert len(made) == 32 and warning is not None and "not open after a restart" in warning
