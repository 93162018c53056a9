"""API keys: shown once, stored only hashed, resolved with a short cache, revoked everywhere; the CLI."""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.accounting import keys
from gateway.cli import store as store_cli
from gateway.errors import Forbidden, StoreUnavailable, Unauthorized
from gateway.policy.tenancy import AuthPolicy
from gateway.store.contract import Store
from gateway.store.fallback import FallbackStore
from gateway.store.memory import MemoryStore
from gateway.store.redis_store import RedisStore
from tests.fixtures.redis_server import RedisServer


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def store(request: pytest.FixtureRequest, key_prefix: str) -> AsyncIterator[Store]:
    if request.param == "memory":
        yield MemoryStore(prefix=key_prefix)
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    s = RedisStore(server.url, prefix=key_prefix)
    yield s
    await s.close()


async def _everything_in_redis(url: str) -> list[str]:
    client = aioredis.Redis.from_url(url, decode_responses=True)
    out: list[str] = []
    async for key in client.scan_iter():
        kind = await client.type(key)
        if kind == "none":  # expired since the scan saw it
            continue
        value: Any = {
            "hash": client.hgetall, "set": client.smembers, "string": client.get,
            "zset": lambda k: client.zrange(k, 0, -1, withscores=True),
            "list": lambda k: client.lrange(k, 0, -1),
            "stream": client.xrange,  # shadow pairs other tests left on the shared server
        }[kind](key)  # fmt: skip
        out += [key, json.dumps(await value, default=str)]
    await client.aclose()
    return out


async def test_raw_key_is_never_stored(store: Store, redis_server: RedisServer) -> None:
    record, raw = await keys.create(store, "acme", "ci")
    assert raw.startswith(f"{record.prefix}-") and record.digest == keys.digest(raw)
    secret = raw.rsplit("-", 1)[1]
    if isinstance(store, MemoryStore):
        dumped = json.dumps(store.dump(), default=str)
    else:
        dumped = "\n".join(await _everything_in_redis(redis_server.url))
    assert record.digest in dumped
    assert raw not in dumped and secret not in dumped


async def test_key_resolves_to_tenant_until_revoked(store: Store) -> None:
    record, raw = await keys.create(store, "acme")
    ring = keys.KeyRing(store, fresh_s=0.0)  # no cache: revocation shows at once
    assert await ring.tenant(f"Bearer {raw}") == "acme"
    assert [r.prefix for r in await store.list_keys()] == [record.prefix]
    assert await keys.revoke(store, record.prefix) == record
    with pytest.raises(Unauthorized) as info:
        await ring.tenant(f"Bearer {raw}")
    assert raw not in str(info.value.envelope())
    with pytest.raises(Unauthorized):
        await ring.tenant(None)
    with pytest.raises(Unauthorized):
        await ring.tenant("Basic abc")


def test_pepper_changes_the_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = keys.digest("agk-1-x")
    monkeypatch.setenv(keys.PEPPER_ENV, "pepper")
    assert keys.digest("agk-1-x") != plain


@pytest.mark.redis
async def test_cached_keys_survive_a_store_outage(private_redis: RedisServer) -> None:
    store = FallbackStore(RedisStore(private_redis.url, timeout_s=0.2), MemoryStore(), retry_s=5)
    _, raw = await keys.create(store, "acme")
    _, unseen = await keys.create(store, "acme")
    ring = keys.KeyRing(store, fresh_s=0.0)
    assert await ring.tenant(f"Bearer {raw}") == "acme"
    private_redis.kill()
    assert await ring.tenant(f"Bearer {raw}") == "acme"
    with pytest.raises(StoreUnavailable):  # cannot tell; never a false 401
        await ring.tenant(f"Bearer {unseen}")
    await store.close()


def test_check_admin() -> None:
    auth = AuthPolicy(admin_token_env="TEST_ADMIN")
    keys.check_admin("Bearer s3cret", auth, environ={"TEST_ADMIN": "s3cret"})
    with pytest.raises(Unauthorized):
        keys.check_admin("Bearer nope", auth, environ={"TEST_ADMIN": "s3cret"})
    with pytest.raises(Forbidden):
        keys.check_admin("Bearer s3cret", auth, environ={})


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="agent-gateway")
    store_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


@pytest.mark.redis
def test_cli_create_list_revoke_usage(redis_server: RedisServer, capsys: pytest.CaptureFixture[str]) -> None:
    url = redis_server.url
    assert _cli("keys", "create", "--tenant", "cli-tenant", "--name", "laptop", "--redis-url", url) == 0
    raw = capsys.readouterr().out.strip()
    assert raw.startswith("agk-")
    assert _cli("keys", "list", "--redis-url", url) == 0
    listed = capsys.readouterr().out
    prefix = raw.rsplit("-", 1)[0]
    assert prefix in listed and "cli-tenant" in listed and raw not in listed
    assert _cli("keys", "revoke", prefix, "--redis-url", url) == 0
    assert _cli("keys", "revoke", prefix, "--redis-url", url) == 2
    assert "no key" in capsys.readouterr().err
    assert _cli("keys", "create", "--tenant", "a{b}", "--redis-url", url) == 2
    assert "--tenant" in capsys.readouterr().err
    assert _cli("usage", "--tenant", "nobody", "--redis-url", url) == 0
    assert "SPEND_USD" in capsys.readouterr().out
    assert _cli("usage", "--json", "--redis-url", url) == 0
    assert json.loads(capsys.readouterr().out)["object"] == "usage"


def test_cli_without_store_or_with_dead_store(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(store_cli.REDIS_URL_ENV, raising=False)
    assert _cli("usage") == 2
    assert "--redis-url" in capsys.readouterr().err
    assert _cli("keys", "list", "--redis-url", "redis://:hunter2@127.0.0.1:1/0", "--timeout-s", "0.2") == 2
    err = capsys.readouterr().err
    assert "hunter2" not in err and err.count("\n") == 1


class _CountedStore(MemoryStore):
    """The in-memory store, counting the key lookups that reach it."""

    lookups = 0

    async def find_key(self, d: str) -> Any:
        self.lookups += 1
        return await super().find_key(d)


async def test_a_token_not_shaped_like_a_key_costs_no_lookup_and_unknown_keys_are_remembered() -> None:
    store = _CountedStore()
    _, raw = await keys.create(store, "acme")
    ring = keys.KeyRing(store)
    for token in ("sk-client-secret", "agk-00000000-wrong", raw.upper(), raw + "0", "x" * 10_000, raw[:-1]):
        with pytest.raises(Unauthorized):
            await ring.tenant(f"Bearer {token}")
    assert store.lookups == 0
    unknown = f"agk-{'0' * 8}-{'1' * 40}"
    for _ in range(5):
        with pytest.raises(Unauthorized):
            await ring.tenant(f"Bearer {unknown}")
    assert store.lookups == 1  # then remembered as unknown for fresh_s
    assert await ring.tenant(f"Bearer {raw}") == "acme" and store.lookups == 2


@pytest.mark.redis
async def test_a_flood_of_unknown_keys_never_drops_the_known_ones(private_redis: RedisServer) -> None:
    store = FallbackStore(RedisStore(private_redis.url, timeout_s=0.2), MemoryStore(), retry_s=5)
    known = [raw for _, raw in [await keys.create(store, t) for t in ("acme", "globex", "initech")]]
    ring = keys.KeyRing(store, fresh_s=0.0, max_entries=3)
    for raw in known:
        await ring.tenant(f"Bearer {raw}")
    for i in range(50):  # made-up keys, well formed: each one looked up, none of them a key
        with pytest.raises(Unauthorized):
            await ring.tenant(f"Bearer agk-{i:08x}-{'a' * 40}")
    _, fourth = await keys.create(store, "umbrella")
    assert await ring.tenant(f"Bearer {fourth}") == "umbrella"  # beyond max_entries: the least recent goes
    private_redis.kill()
    assert [await ring.tenant(f"Bearer {raw}") for raw in (*known[1:], fourth)] == ["globex", "initech", "umbrella"]
    with pytest.raises(StoreUnavailable):
        await ring.tenant(f"Bearer {known[0]}")  # dropped, alone, when the fourth came
    await store.close()
