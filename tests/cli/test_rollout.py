"""The rollout and shadow CLI against a stand-in admin API (the real one lands with the request path)."""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from gateway.cli.rollout import register
from gateway.rollout.comparison import Capture, compare
from gateway.rollout.state import start
from gateway.rollout.step import status
from tests.fixtures.rollout_scripts import samples, scripted, spec_of

SPEC = spec_of("steps: [{set_weight: 10}, {pause: {}}, {set_weight: 100}]")
STATE = start(SPEC.id, 0)
STATUS = status(SPEC, STATE, scripted(samples(50, 1), samples(50)), 10)


class AdminApi(BaseHTTPRequestHandler):
    posts: list[tuple[str, dict[str, Any], str | None]] = []

    def _reply(self, code: int, body: Any) -> None:
        raw = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        if self.path == "/admin/rollouts":
            self._reply(200, {"auto": STATUS})
        elif self.path == "/admin/rollouts/auto":
            self._reply(200, STATUS)
        elif self.path == "/admin/rollouts/auto/history":
            self._reply(200, [t.to_dict() for t in STATE.history])
        else:
            self._reply(
                404,
                {
                    "error": {
                        "message": "no rollout on route 'nope'",
                        "type": "invalid_request_error",
                        "code": "not_found",
                    }
                },
            )

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        AdminApi.posts.append((self.path, body, self.headers.get("Authorization")))
        if body["generation"] != STATUS["generation"]:
            self._reply(
                409,
                {
                    "error": {
                        "message": "pause: generation 7 is stale, the rollout is at generation 1",
                        "type": "conflict_error",
                        "code": "stale_generation",
                    }
                },
            )
        else:
            self._reply(200, {**STATUS, "phase": "Paused", "generation": STATUS["generation"] + 1})

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def admin_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), AdminApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    AdminApi.posts.clear()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="agent-gateway")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


def test_status_prints_per_metric_verdicts(admin_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("rollout", "status", "--url", admin_url) == 0
    out = capsys.readouterr().out
    assert "auto: Progressing  rollout hq-v2-1  deployment:hq -> deployment:hq-v2" in out
    assert "error_rate" in out and "n=50" in out and "inconclusive" in out


def test_actions_send_actor_reason_generation_and_token(
    admin_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENT_GATEWAY_ADMIN_TOKEN", "s3cret")
    assert run("rollout", "pause", "auto", "--url", admin_url, "--actor", "ana", "--reason", "look") == 0
    assert AdminApi.posts[-1] == (
        "/admin/rollouts/auto/pause",
        {"actor": "ana", "reason": "look", "generation": 1},
        "Bearer s3cret",
    )
    assert run("rollout", "promote", "auto", "--full", "--url", admin_url, "--generation", "1") == 0
    path, _, _ = AdminApi.posts[-1]
    assert path.endswith("/promote_full")
    assert "Paused" in capsys.readouterr().out


def test_stale_generation_is_one_line_and_exit_2(admin_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("rollout", "abort", "auto", "--url", admin_url, "--reason", "x", "--generation", "7") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "HTTP 409" in err and "[stale_generation]" in err
    assert run("rollout", "status", "nope", "--url", admin_url) == 2
    assert "no rollout on route 'nope' [not_found]" in capsys.readouterr().err


def test_unreachable_gateway_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("rollout", "status", "--url", "http://127.0.0.1:9", "--timeout-s", "2") == 2
    assert "cannot reach the gateway" in capsys.readouterr().err


def test_history_lists_audited_transitions(admin_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("rollout", "history", "auto", "--url", admin_url) == 0
    assert "start" in capsys.readouterr().out


def test_shadow_report_works_offline_on_a_jsonl_export(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ok = Capture(
        200, 100.0, 20.0, body={"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]}
    )
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("\n".join(json.dumps(compare({"temperature": 0}, ok, ok)) for _ in range(12)) + "\n")
    assert run("shadow", "report", "--file", str(pairs)) == 0
    out = capsys.readouterr().out
    assert "shadow pairs: 12" in out and "exact_match" in out
    pairs.write_text("{not json\n")
    assert run("shadow", "report", "--file", str(pairs)) == 2
    assert f"{pairs}:1: not a JSON object" in capsys.readouterr().err
    assert run("shadow", "report", "--file", str(tmp_path / "missing.jsonl")) == 2
