"""The `context show REF` sub-command: the original of a masked tool output, by the reference its stub names.

With a tenant's API key (`--api-key`, env AGENT_GATEWAY_API_KEY) it reads `GET /v1/context/REF` as that tenant;
otherwise the admin API's `GET /admin/context/REF?tenant=T` with the admin token.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.parse
from typing import Any

from gateway.cli.admin_client import client_options, guarded, request_bytes

API_KEY_ENV = "AGENT_GATEWAY_API_KEY"


def cmd_show(args: argparse.Namespace) -> int:
    ref = urllib.parse.quote(args.ref, safe="")
    api_key = args.api_key or os.environ.get(API_KEY_ENV)
    if api_key:
        found = request_bytes(args, "GET", f"/v1/context/{ref}", token=api_key)
    else:
        query = f"?tenant={urllib.parse.quote(args.tenant, safe='')}" if args.tenant else ""
        found = request_bytes(args, "GET", f"/admin/context/{ref}{query}")
    sys.stdout.buffer.write(found)
    sys.stdout.flush()
    return 0


def register(sub: Any) -> None:
    context = sub.add_parser("context", help="masked tool outputs, by the reference their stubs name")
    csub = context.add_subparsers(dest="context_command", required=True, metavar="ACTION")
    show = csub.add_parser("show", help="print the original of a masked tool output")
    show.add_argument("ref", metavar="REF", help="the reference a stub names (ctx_ and 64 hex digits)")
    show.add_argument("--tenant", help="whose reference it is (admin API; default: the anonymous tenant)")
    show.add_argument("--api-key", help=f"read it as this API key's tenant instead (env {API_KEY_ENV})")
    client_options(show)
    show.set_defaults(func=guarded(cmd_show))
