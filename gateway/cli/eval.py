"""The `agent-gateway eval` command: each case of an evaluation set run as an agent loop through the gateway
under each policy, each run's outcome reported through the outcome API, and the policies compared.

    agent-gateway eval --cases evals/examples.yaml --policy policies/default.yaml --policy candidate.yaml
        one gateway per policy file, started in this process against the deployments the file declares
    agent-gateway eval --cases evals/examples.yaml --url http://gateway:8080 --policy auto --policy fast
        a running gateway; each --policy is then a route (client model name) on it
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from gateway.cli.eval_cases import Case, CaseError, Run, check, load, parse_arguments
from gateway.cli.eval_report import Result, difference, summary, table

API_KEY_ENV = "AGENT_GATEWAY_API_KEY"
STEP_TIMEOUT_S = 300.0  # one model call of a case; a CPU vLLM answering 256 tokens needs well under this


@dataclass(frozen=True, slots=True)
class Target:
    """Where one policy's runs go: a gateway's base URL and the model name its requests ask for."""

    name: str
    url: str
    model: str


class EvalError(Exception):
    """One line for the user; the command exits 2."""


async def run_case(http: aiohttp.ClientSession, target: Target, index: int, case: Case, repeat: int,
                   run_id: str, api_key: str) -> Result:
    """One agent run: call, run the tools the model asks for, send their outputs back, until it answers or
    max_steps; then check it against the case and report the outcome."""
    session = f"eval-{run_id}-p{index}-{case.id}-{repeat}"
    headers = {"x-session-id": session, **({"authorization": f"Bearer {api_key}"} if api_key else {})}
    messages, run, step_ms, failed = case.messages(), Run(), [], ""
    tools = {t.name: t for t in case.tools}
    started = time.perf_counter()
    for _ in range(case.max_steps):
        body: dict[str, Any] = {"model": target.model, "messages": messages, "max_tokens": case.max_tokens,
                                "temperature": case.temperature}
        if tools:
            body["tools"] = [t.spec() for t in case.tools]
        sent = time.perf_counter()
        status, reply = await _post(http, f"{target.url}/v1/chat/completions", body, headers)
        step_ms.append((time.perf_counter() - sent) * 1000)
        if status != 200:
            failed = f"step {len(step_ms)}: HTTP {status}: {_message(reply)}"
            break
        message = ((reply.get("choices") or [{}])[0]).get("message") or {}
        calls = message.get("tool_calls") or []
        if not calls:
            run.answer = message.get("content") or ""
            break
        messages.append({"role": "assistant", "content": message.get("content"), "tool_calls": calls})
        for call in calls:
            function = call.get("function") or {}
            name = str(function.get("name", ""))
            run.calls.append((name, parse_arguments(function.get("arguments"))))
            output = tools[name].result if name in tools else f"Error: there is no tool {name!r}"
            messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": output})
    session_s = time.perf_counter() - started
    passed, reason = (False, failed) if failed else check(case, run)
    labels = {"task": case.id, "eval": run_id, "policy": target.name[:256]}
    status, reply = await _post(http, f"{target.url}/v1/sessions/{session}/outcome",
                                {"success": passed, "reason": reason[:1024], "labels": labels}, headers)
    recorded = status == 200
    cost = float(reply["outcome"]["cost_usd"]) if recorded else None
    return Result(target.name, case.id, repeat, case.tags, passed, reason, len(step_ms), cost, session_s, step_ms,
                  session, recorded)


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
                headers: dict[str, str]) -> tuple[int, Any]:
    try:
        async with http.post(url, json=body, headers=headers,
                             timeout=aiohttp.ClientTimeout(total=STEP_TIMEOUT_S)) as resp:
            return resp.status, await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise EvalError(f"POST {url}: cannot reach the gateway ({exc.__class__.__name__}: {exc})") from None
    except ValueError:
        return 502, {"error": {"message": "the reply is not JSON"}}


def _message(reply: Any) -> str:
    error = reply.get("error") if isinstance(reply, dict) else None
    return str(error.get("message", error))[:200] if isinstance(error, dict) else str(reply)[:200]


@contextlib.asynccontextmanager
async def gateways(policies: Sequence[str], model: str) -> AsyncIterator[list[Target]]:
    """One gateway per policy file, each on a free loopback port of this process, closed on the way out."""
    from aiohttp import web

    from gateway.policy.model import PolicyError
    from gateway.server.app import create_app
    from gateway.server.listener import GatewayRunner
    from gateway.server.settings import Settings

    runners: list[web.AppRunner] = []
    targets = []
    try:
        for i, path in enumerate(policies):
            if not Path(path).is_file():
                raise EvalError(f"--policy {path}: no such policy file (give --url to name routes of a gateway)")
            settings = Settings.from_env(policy=path, admin_token=secrets.token_hex(16), port=0)
            try:
                runner = GatewayRunner(create_app(settings), settings)
                await runner.setup()
            except PolicyError as exc:
                raise EvalError(f"--policy {path}: {exc}") from None
            runners.append(runner)
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            host, port = runner.addresses[0][:2]
            targets.append(Target(_name(path, i, policies), f"http://{host}:{port}", model))
        yield targets
    finally:
        for started in reversed(runners):
            await started.cleanup()


def _name(path: str, index: int, policies: Sequence[str]) -> str:
    stem = Path(path).stem
    return stem if [Path(p).stem for p in policies].count(stem) == 1 else f"{stem}#{index + 1}"


async def evaluate(args: argparse.Namespace, cases: Sequence[Case]) -> list[Result]:
    run_id = secrets.token_hex(4)
    api_key = args.api_key or os.environ.get(API_KEY_ENV, "")
    async with contextlib.AsyncExitStack() as stack:
        if args.url:
            targets = [Target(p, args.url.rstrip("/"), p) for p in args.policy]
        else:
            targets = await stack.enter_async_context(gateways(args.policy, args.model))
        http = await stack.enter_async_context(aiohttp.ClientSession())
        results = []
        for repeat in range(args.repeat):
            for case in cases:  # each case under every policy in turn: a drift in load hits them alike
                for index, target in enumerate(targets):
                    results.append(await run_case(http, target, index, case, repeat, run_id, api_key))
                    if args.verbose:
                        r = results[-1]
                        print(f"  {target.name} {case.id}#{repeat}: {'pass' if r.passed else 'FAIL'} ({r.reason})",
                              file=sys.stderr)
        return results


def cmd_eval(args: argparse.Namespace) -> int:
    try:
        cases = load(args.cases)
        if args.repeat < 1:
            raise EvalError(f"--repeat must be at least 1, got {args.repeat}")
        results = asyncio.run(evaluate(args, cases))
    except (CaseError, EvalError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    names = list(dict.fromkeys(r.policy for r in results))
    by_policy = {name: [r for r in results if r.policy == name] for name in names}
    summaries = {name: summary(found) for name, found in by_policy.items()}
    differences = {name: difference(by_policy[names[0]], by_policy[name]) for name in names[1:]}
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r.to_dict()) + "\n" for r in results), encoding="utf-8")
    if args.json:
        print(json.dumps({"cases": len(cases), "policies": names, "summaries": summaries,
                          "differences": differences}, indent=2))
    else:
        print(f"{len(cases)} cases x {args.repeat} under {len(names)} policies ({len(results)} agent runs; "
              f"outcomes recorded: {sum(r.outcome_recorded for r in results)})\n")
        print(table(names, summaries, differences))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `eval` to the agent-gateway parser."""
    parser = subparsers.add_parser("eval", help="run an evaluation set as agent loops under policies; compare them")
    parser.add_argument("--cases", required=True, help="the cases YAML (see evals/examples.yaml)")
    parser.add_argument("--policy", action="append", required=True,
                        help="a policy file (one in-process gateway each), or with --url a route; repeat to compare")
    parser.add_argument("--url", help="a running gateway instead of in-process ones; --policy names its routes")
    parser.add_argument("--model", default="auto", help="the model (route) the runs ask in-process gateways for")
    parser.add_argument("--api-key", help=f"the API key of the gateway, when it requires one (env {API_KEY_ENV})")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each case under each policy (default 1)")
    parser.add_argument("--out", help="also write every run as JSONL here")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    parser.add_argument("--verbose", action="store_true", help="print each run's verdict to stderr as it ends")
    parser.set_defaults(func=cmd_eval)
