"""`agent-gateway keys create|list|revoke` and `agent-gateway usage`: the shared store from a shell."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from gateway.accounting import keys
from gateway.accounting.budgets import usage_report
from gateway.store.contract import StoreError, UsageRow

if TYPE_CHECKING:  # imported when a command runs: `serve` parses this CLI and must not load redis
    from gateway.store.redis_store import RedisStore

REDIS_URL_ENV = "AGENT_GATEWAY_REDIS_URL"


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `keys` and `usage` to the agent-gateway CLI."""
    store_opts = argparse.ArgumentParser(add_help=False)
    store_opts.add_argument(
        "--redis-url", default=os.environ.get(REDIS_URL_ENV), help=f"default: ${REDIS_URL_ENV}"
    )
    store_opts.add_argument("--timeout-s", type=float, default=2.0, help="per Redis command")

    key_cmd = subparsers.add_parser("keys", help="API keys: create, list, revoke")
    key_sub = key_cmd.add_subparsers(dest="keys_command", required=True)
    create = key_sub.add_parser("create", parents=[store_opts], help="create a key; it is printed once")
    create.add_argument("--tenant", required=True)
    create.add_argument("--name", default="", help="a label shown by `keys list`")
    create.set_defaults(func=lambda a: _with_store(a, _create))
    listing = key_sub.add_parser("list", parents=[store_opts], help="list keys (prefix, tenant, created)")
    listing.set_defaults(func=lambda a: _with_store(a, _list))
    revoke = key_sub.add_parser("revoke", parents=[store_opts], help="revoke a key by id or prefix")
    revoke.add_argument("key", help="the id (1a2b3c4d) or prefix (agk-1a2b3c4d) shown by `keys list`")
    revoke.set_defaults(func=lambda a: _with_store(a, _revoke))

    usage = subparsers.add_parser(
        "usage", parents=[store_opts], help="spend and tokens per tenant and window"
    )
    usage.add_argument("--tenant")
    usage.add_argument("--json", action="store_true", help="print the admin endpoint's JSON")
    usage.set_defaults(func=lambda a: _with_store(a, _usage))


def _with_store(
    args: argparse.Namespace, command: Callable[[RedisStore, argparse.Namespace], Awaitable[int]]
) -> int:
    if not args.redis_url:
        print(
            f"agent-gateway: no --redis-url (or ${REDIS_URL_ENV}); the embedded store lives in the server",
            file=sys.stderr,
        )
        return 2

    async def run() -> int:
        from gateway.store.redis_store import RedisStore

        store = RedisStore(args.redis_url, timeout_s=args.timeout_s)
        try:
            return await command(store, args)
        finally:
            await store.close()

    try:
        return asyncio.run(run())
    except StoreError as exc:
        print(f"agent-gateway: store {_safe_url(args.redis_url)}: {exc}", file=sys.stderr)
        return 2


def _safe_url(url: str) -> str:
    """The URL without its password."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}"


async def _create(store: RedisStore, args: argparse.Namespace) -> int:
    try:
        record, raw = await keys.create(store, args.tenant, args.name)
    except ValueError as exc:
        print(f"agent-gateway: keys create: --tenant: {exc}", file=sys.stderr)
        return 2
    print(raw)
    print(
        f"created {record.prefix} for tenant {record.tenant}; the key is shown only this once",
        file=sys.stderr,
    )
    return 0


async def _list(store: RedisStore, args: argparse.Namespace) -> int:
    rows = [(r.prefix, r.tenant, _when(r.created_s), r.name) for r in await store.list_keys()]
    _table(("PREFIX", "TENANT", "CREATED", "NAME"), rows)
    return 0


async def _revoke(store: RedisStore, args: argparse.Namespace) -> int:
    record = await keys.revoke(store, args.key)
    if record is None:
        print(f"agent-gateway: keys revoke: no key {args.key!r}", file=sys.stderr)
        return 2
    print(f"revoked {record.prefix} (tenant {record.tenant})")
    return 0


async def _usage(store: RedisStore, args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps(await usage_report(store, args.tenant), indent=2))
        return 0
    rows: list[UsageRow] = await store.usage(args.tenant)
    _table(
        (
            "TENANT",
            "WINDOW",
            "DEPLOYMENT",
            "SPEND_USD",
            "RESERVED_USD",
            "TOKENS_IN",
            "TOKENS_OUT",
            "REQUESTS",
        ),
        [
            (
                r.tenant,
                str(r.window),
                r.deployment,
                f"{r.spend_usd:.6f}",
                f"{r.reserved_usd:.6f}",
                str(r.tokens_in),
                str(r.tokens_out),
                str(r.requests),
            )
            for r in rows
        ],
    )
    return 0


def _when(ts: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    for row in (header, *rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
