"""The request log keeps the headers a replay needs, and never one that looks like a credential."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.experiments import request_log
from gateway.experiments.request_log import loggable_headers
from gateway.server.resources import STATE
from tests.fixtures.conditions import until
from tests.fixtures.stack import Stack

HELLO = [{"role": "user", "content": "hi"}]
RULES = """
    rules:
      - name: hard-to-hq
        when: {complexity: {gte: 0.99}}
        use: hq
"""
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


async def test_the_finish_path_scores_nothing_and_the_flush_scores_a_line_the_decision_did_not(
    make_stack: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default policy reads no complexity: the line still carries a score, worked out at the log's flush,
    never while the request finishes."""
    monkeypatch.setattr(request_log, "FLUSH_S", 3600.0)  # only the explicit flush below writes
    log_path = tmp_path / "requests.jsonl"
    stack: Stack = await make_stack(settings={"request_log": str(log_path)})
    app = stack.gateway.app
    classifier, scored = app[STATE].classifier, []
    score = classifier.score
    monkeypatch.setattr(classifier, "score", lambda f: scored.append(f) or score(f))
    async with stack.client() as client:
        await client.chat.completions.create(model="auto", messages=HELLO)
    experiments = app[STATE].experiments
    await until(lambda: experiments.log is not None and len(experiments.log._buffer) == 1, what="the line queued")
    assert scored == []  # the request finished without scoring
    assert experiments.log is not None
    await experiments.log.flush()
    line = json.loads(log_path.read_text())
    assert len(scored) == 1 and line["complexity"] == pytest.approx(score(scored[0]))


async def test_a_line_keeps_the_score_the_decision_read(make_stack: Any, tmp_path: Path) -> None:
    log_path = tmp_path / "requests.jsonl"
    stack: Stack = await make_stack(rules=RULES, settings={"request_log": str(log_path)})
    async with stack.client() as client:
        raw = await client.chat.completions.with_raw_response.create(model="auto", messages=HELLO)
    await until(lambda: log_path.exists() and log_path.read_text().count("\n") == 1, what="the log line")
    line = json.loads(log_path.read_text())
    assert line["complexity"] is not None and line["decision"]["rule"] == raw.headers["x-gateway-rule"]
    assert line["served_by"] == raw.headers["x-gateway-deployment"] and line["status"] == 200
