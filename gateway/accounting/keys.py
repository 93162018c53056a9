"""API keys: created once and shown once, stored only as a digest, resolved to a tenant on every request.

Contract for the core:

    ring = KeyRing(store)                                # one per process, owned by create_app
    tenant = await ring.tenant(request.headers.get("Authorization"))   # raises errors.Unauthorized (401)
    check_admin(request.headers.get("Authorization"), policy.auth, settings.admin_token)  # 401 / 403

The digest is HMAC-SHA256 keyed by the `AGENT_GATEWAY_KEY_PEPPER` environment variable when it is
set (changing it invalidates every key), else SHA-256: keys are 160-bit random, so a plain hash
cannot be reversed. Nothing here logs a key; errors say "invalid API key" without echoing it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from gateway.errors import Forbidden, StoreUnavailable, Unauthorized
from gateway.policy.tenancy import AuthPolicy
from gateway.store.contract import KeyRecord, Store

PEPPER_ENV = "AGENT_GATEWAY_KEY_PEPPER"
ADMIN_TOKEN_ENV = "AGENT_GATEWAY_ADMIN_TOKEN"
# tenant names end up inside store keys ({tenant} hash tags): no braces, spaces or wildcards
TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
KEY_PREFIX = "agk"
KEY_FORMAT = re.compile(rf"{KEY_PREFIX}-[0-9a-f]{{8}}-[0-9a-f]{{40}}")  # what `create` makes; nothing else is a key


def digest(raw_key: str, pepper: str | None = None) -> str:
    """The stored form of a key."""
    pepper = os.environ.get(PEPPER_ENV) if pepper is None else pepper
    if pepper:
        return hmac.new(pepper.encode(), raw_key.encode(), hashlib.sha256).hexdigest()
    return hashlib.sha256(raw_key.encode()).hexdigest()


async def create(store: Store, tenant: str, name: str = "") -> tuple[KeyRecord, str]:
    """A new key for `tenant`: the record as stored and the raw key, which is never stored nor shown again."""
    if not TENANT_NAME.fullmatch(tenant):
        raise ValueError(f"tenant {tenant!r}: use 1-64 letters, digits, '_', '.' or '-'")
    key_id = secrets.token_hex(4)
    raw = f"{KEY_PREFIX}-{key_id}-{secrets.token_hex(20)}"  # hex: a double-click selects it whole
    record = KeyRecord(key_id, tenant, f"{KEY_PREFIX}-{key_id}", digest(raw), time.time(), name)
    await store.put_key(record)
    return record, raw


async def revoke(store: Store, id_or_prefix: str) -> KeyRecord | None:
    """Delete a key given its id (`1a2b3c4d`) or its shown prefix (`agk-1a2b3c4d`)."""
    key_id = id_or_prefix.removeprefix(f"{KEY_PREFIX}-")
    return await store.delete_key(key_id)


def bearer(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


class KeyRing:
    """Key lookups for the request path, cached for `fresh_s` so most requests skip the store.

    A revoked key stops working on every replica within `fresh_s`. While the store is down a cached key
    keeps working (its tenant is known); an uncached one gets StoreUnavailable (503), never a 401.

    A token that is not shaped like a key is refused without a lookup. Keys the store does not have are
    remembered apart (`max_unknown`, least recent dropped first), so a flood of made-up keys can never push
    out the known ones; known keys are dropped one at a time, least recently used first, beyond `max_entries`.
    """

    def __init__(self, store: Store, *, fresh_s: float = 5.0, max_entries: int = 100_000,
                 max_unknown: int = 10_000) -> None:
        self._store = store
        self._fresh_s = fresh_s
        self._max_entries, self._max_unknown = max_entries, max_unknown
        self._known: OrderedDict[str, tuple[float, str]] = OrderedDict()  # digest -> (looked up at, tenant)
        self._unknown: OrderedDict[str, float] = OrderedDict()  # digest -> looked up at (no such key then)

    async def tenant(self, authorization: str | None) -> str:
        raw = bearer(authorization)
        if raw is None:
            raise Unauthorized("Missing API key: send 'Authorization: Bearer <key>'")
        if not KEY_FORMAT.fullmatch(raw):
            raise Unauthorized("Invalid API key")
        d = digest(raw)
        now = time.monotonic()
        known = self._known.get(d)
        if known is not None:
            self._known.move_to_end(d)
            if now - known[0] <= self._fresh_s:
                return known[1]
        elif now - self._unknown.get(d, -float("inf")) <= self._fresh_s:
            raise Unauthorized("Invalid API key")
        try:
            record = await self._store.find_key(d)
        except StoreUnavailable:
            if known is None:
                raise
            return known[1]  # the store is down: a key it knew keeps its tenant
        if record is None:
            self._known.pop(d, None)
            _remember(self._unknown, d, now, self._max_unknown)
            raise Unauthorized("Invalid API key")
        self._unknown.pop(d, None)
        _remember(self._known, d, (now, record.tenant), self._max_entries)
        return record.tenant


def _remember(cache: OrderedDict[str, Any], d: str, entry: Any, max_entries: int) -> None:
    """Put an entry at the recent end; beyond `max_entries` the least recently used one goes (only it)."""
    cache[d] = entry
    cache.move_to_end(d)
    while len(cache) > max_entries:
        cache.popitem(last=False)


def check_admin(
    authorization: str | None, auth: AuthPolicy, default_token: str = "", environ: Mapping[str, str] = os.environ
) -> None:
    """The one admin check: a bearer token equal to the one in the variable `auth.admin_token_env` names
    (for the default AGENT_GATEWAY_ADMIN_TOKEN, the value the process read at start); unset means disabled."""
    env = auth.admin_token_env
    expected = default_token if env == ADMIN_TOKEN_ENV else environ.get(env, "")
    if not expected:
        raise Forbidden("The admin API is disabled: set its token's environment variable "
                        "(AGENT_GATEWAY_ADMIN_TOKEN, or the policy's auth.admin_token_env)")
    given = bearer(authorization) or ""
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise Unauthorized(
            "A valid admin token is required (Authorization: Bearer <token>)", code="invalid_admin_token"
        )
