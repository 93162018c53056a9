"""The admin API as the CLI's command groups (rollout, shadow, sessions) call it: options, one request, errors."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

TOKEN_ENV = "AGENT_GATEWAY_ADMIN_TOKEN"
URL_ENV = "AGENT_GATEWAY_URL"


class CliError(Exception):
    """A one-line message for the user; the command exits 2."""


def request(args: argparse.Namespace, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """One admin API call; every failure becomes a CliError naming the URL and the gateway's message."""
    url = args.url.rstrip("/") + path
    try:
        return json.loads(request_bytes(args, method, path, body) or b"null")
    except ValueError:
        raise CliError(f"{method} {url}: the reply is not JSON") from None


def request_bytes(args: argparse.Namespace, method: str, path: str, body: dict[str, Any] | None = None,
                  token: str | None = None) -> bytes:
    """One call's answer as it came; `token` signs it in instead of the admin token (a tenant's API key)."""
    url = args.url.rstrip("/") + path
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Accept", "application/json")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    token = token or args.admin_token or os.environ.get(TOKEN_ENV)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=args.timeout_s) as resp:
            found: bytes = resp.read()
            return found
    except urllib.error.HTTPError as exc:
        raise CliError(f"{method} {url}: HTTP {exc.code}: {_envelope_message(exc.read())}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise CliError(f"{method} {url}: cannot reach the gateway ({reason})") from None


def _envelope_message(raw: bytes) -> str:
    try:
        error = json.loads(raw)["error"]
        code = f" [{error['code']}]" if error.get("code") else ""
        return f"{error['message']}{code}"
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode(errors="replace").strip() or "no message"


def guarded(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except CliError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2

    return run


def client_options(parser: argparse.ArgumentParser) -> None:
    """Where the gateway is and how to sign in: --url, --admin-token, --timeout-s, and --json output."""
    parser.add_argument(
        "--url",
        default=os.environ.get(URL_ENV, "http://127.0.0.1:8080"),
        help=f"gateway base URL (env {URL_ENV})",
    )
    parser.add_argument("--admin-token", default=None, help=f"admin bearer token (default: env {TOKEN_ENV})")
    parser.add_argument("--timeout-s", type=float, default=10.0)
    parser.add_argument("--json", action="store_true", help="print the API's JSON instead of a table")
