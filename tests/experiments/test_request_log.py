"""The request log keeps the headers a replay needs, and never one that looks like a credential."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gateway.experiments.request_log import loggable_headers
from tests.fixtures.conditions import until
from tests.fixtures.stack import Stack

HELLO = [{"role": "user", "content": "hi"}]
SENT = {
    "x-priority": "high",  # read by the test policy's priority-header rule
    "x-session-id": "agent-7",
    "x-auth-token": "tok-secret-1",
    "x-api-key": "key-secret-2",
    "x-internal-signature": "sig-secret-3",
    "x-debug-note": "not read by any rule",
}


def test_only_headers_the_policy_reads_are_kept_and_credentials_never() -> None:
    wanted = frozenset({"x-priority", "x-tenant-token"})  # a rule reading a credential-like header
    headers = {**SENT, "X-Tenant-Token": "tok-secret-4"}
    assert loggable_headers(headers, wanted) == {"x-priority": "high", "x-session-id": "agent-7"}


async def test_a_logged_request_carries_no_credential_header(make_stack: Any, tmp_path: Path) -> None:
    log_path = tmp_path / "requests.jsonl"
    stack: Stack = await make_stack(settings={"request_log": str(log_path)})
    async with stack.client() as client:
        await client.chat.completions.create(model="auto", messages=HELLO, extra_headers=SENT)
    await until(lambda: log_path.exists() and log_path.read_text().count("\n") == 1, what="the log line")
    text = log_path.read_text()
    assert json.loads(text)["headers"] == {"x-priority": "high", "x-session-id": "agent-7"}
    assert "secret" not in text and "sk-client-secret" not in text
