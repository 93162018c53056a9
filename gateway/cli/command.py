"""The `agent-gateway` command line: serve, policy validate|explain|schema, and each area's commands."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from gateway import __version__
from gateway.apis.routes import BY_ENDPOINT
from gateway.errors import GatewayError
from gateway.policy import model as policy_module
from gateway.server.settings import Settings, describe

Register = Callable[[Any], None]


def _registrations() -> list[Register]:
    """Sub-commands owned by other modules; each exposes register(subparsers)."""
    from gateway.cli import classifier as classifier_cli
    from gateway.cli import context as context_cli
    from gateway.cli import eval as eval_cli
    from gateway.cli import rollout as rollout_cli
    from gateway.cli import sessions as sessions_cli
    from gateway.cli import store as store_cli
    from serving import up

    return [up.register, classifier_cli.register, store_cli.register, rollout_cli.register, sessions_cli.register,
            eval_cli.register, context_cli.register]


def build_parser() -> argparse.ArgumentParser:
    env_help = "\n".join(f"  {name} (default {default})" for name, default in describe())
    parser = argparse.ArgumentParser(
        prog="agent-gateway",
        description="OpenAI-compatible routing gateway in front of a high-quality and a fast deployment.",
        epilog="settings also come from the environment:\n" + env_help,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"agent-gateway {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    _add_policy(sub)
    for register in _registrations():
        register(sub)
    return parser


def _add_serve(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--policy", help="policy YAML (env AGENT_GATEWAY_POLICY)")
    serve.add_argument("--host", help="listen address (env AGENT_GATEWAY_HOST, default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="listen port (env AGENT_GATEWAY_PORT, default 8080)")
    serve.add_argument("--workers", type=int, help="processes sharing the port (SO_REUSEPORT)")
    serve.set_defaults(func=serve_command)


def _add_policy(sub: Any) -> None:
    policy = sub.add_parser("policy", help="check and explain routing policies")
    psub = policy.add_subparsers(dest="policy_command", required=True, metavar="ACTION")
    validate = psub.add_parser("validate", help="report every problem in a policy file")
    validate.add_argument("files", nargs="+", metavar="FILE")
    validate.set_defaults(func=validate_command)
    explain = psub.add_parser("explain", help="show the decision and its reasons for one request, offline")
    explain.add_argument("--policy", required=True)
    explain.add_argument("--request", required=True, help="JSON file with an OpenAI request body")
    explain.add_argument("--endpoint", choices=list(BY_ENDPOINT), default="chat",
                         help="the API the request body is in (responses, messages: the agents' own)")
    explain.add_argument("--header", action="append", default=[], metavar="NAME:VALUE")
    explain.add_argument("--tenant")
    explain.add_argument("--spent-usd", action="append", default=[], metavar="WINDOW=USD",
                         help="assume the tenant already spent this much (minute, hour, day, month)")
    explain.add_argument("--session", action="append", default=[], metavar="FIELD=VALUE",
                         help="assume an agent session: steps_per_min=N, cost_usd=USD, pinned=DEPLOYMENT")
    explain.add_argument("--load", action="append", default=[], metavar="DEPLOYMENT:FIELD=VALUE",
                         help="assumed load, e.g. fast:requests_waiting=20 or hq:healthy=0")
    explain.add_argument("--json", action="store_true", help="print JSON")
    explain.set_defaults(func=explain_command)
    schema = psub.add_parser("schema", help="print the policy's JSON Schema (for editors)")
    schema.set_defaults(func=lambda args: print(policy_module.json_schema(), end="") or 0)
    from gateway.cli import simulate

    simulate.add_parser(psub)


def validate_command(args: argparse.Namespace) -> int:
    failed = 0
    for path in args.files:
        try:
            policy_module.load(path)
        except policy_module.PolicyError as exc:
            failed += 1
            for problem in exc.problems:
                print(problem, file=sys.stderr)
            continue
        print(f"{path}: ok")
    return 1 if failed else 0


def explain_command(args: argparse.Namespace) -> int:
    from gateway.cli import explain

    try:
        report = explain.offline(args.policy, args.request, args.endpoint, args.header, args.tenant,
                                 args.load, args.spent_usd, args.session)
    except policy_module.PolicyError as exc:
        print("\n".join(exc.problems), file=sys.stderr)
        return 2
    except (GatewayError, explain.ExplainInputError) as exc:
        print(f"{args.request}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else explain.render(report))
    return 0


def serve_command(args: argparse.Namespace) -> int:
    try:
        settings = Settings.from_env(policy=args.policy, host=args.host, port=args.port, workers=args.workers)
    except ValueError as exc:
        print(f"agent-gateway: {exc}", file=sys.stderr)
        return 2
    if not settings.policy:
        print("agent-gateway serve: give --policy FILE or set AGENT_GATEWAY_POLICY", file=sys.stderr)
        return 2
    try:
        policy = policy_module.load(settings.policy)
    except policy_module.PolicyError as exc:
        print("agent-gateway serve: the policy is not valid:\n" + "\n".join(exc.problems), file=sys.stderr)
        return 2
    if settings.workers > 1 and _split_budgets(settings, policy):
        return 2
    if settings.classifier_model:
        from gateway.classifier.scoring import Classifier, ModelFileError

        try:
            Classifier.load(settings.classifier_model)
        except (OSError, ModelFileError) as exc:
            print(f"agent-gateway serve: AGENT_GATEWAY_CLASSIFIER_MODEL: {exc}", file=sys.stderr)
            return 2
    if settings.workers > 1:
        return _serve_workers(settings)
    run(settings)
    return 0


def _split_budgets(settings: Settings, policy: policy_module.Policy) -> bool:
    """Workers without a shared store each keep their own memory store: refuse (True) when the policy has
    hard limits, which would then hold N times over; else warn of what is kept per worker."""
    if policy.store.redis_url or settings.redis_url:
        return False
    n, path = settings.workers, settings.policy
    fields = hard_limit_fields(policy)
    if fields:
        print(f"agent-gateway serve: {n} workers without a shared store would each enforce the hard limits of "
              f"{path} on their own, allowing up to {n} times each ({', '.join(fields)}); set store.redis_url "
              f"in {path} (or AGENT_GATEWAY_REDIS_URL), or run one worker", file=sys.stderr)
        return True
    print(f"agent-gateway serve: warning: {n} workers without a shared store: each keeps its own soft budgets, "
          "sessions, API keys, rollout state and agent trajectories; set store.redis_url in "
          f"{path} (or AGENT_GATEWAY_REDIS_URL) for one truth", file=sys.stderr)
    return False


def hard_limit_fields(policy: policy_module.Policy) -> list[str]:
    """The policy's hard limits, by field path (tenants[0].budgets[1].hard_usd, sessions.cost_cap_usd …)."""
    fields: list[str] = []
    for i, tenant in enumerate(policy.tenants):
        for j, budget in enumerate(tenant.budgets):
            fields += [f"tenants[{i}].budgets[{j}].{name}" for name in ("hard_usd", "hard_tokens")
                       if getattr(budget, name) is not None]
        fields += [f"tenants[{i}].{name}" for name in ("requests_per_minute", "tokens_per_minute", "max_concurrent")
                   if getattr(tenant, name) is not None]
    if policy.sessions.cost_cap_usd is not None:
        fields.append("sessions.cost_cap_usd")
    return fields


def run(settings: Settings) -> None:
    from gateway.server.app import create_app
    from gateway.server.listener import serve
    from gateway.upstream.client import one_heap

    one_heap()  # before the span exporter's thread and the executor's start
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _use_uvloop()
    print(f"agent-gateway {__version__} listening on http://{settings.host}:{settings.port} "
          f"(policy {settings.policy}, pid {os.getpid()})", flush=True)
    asyncio.run(serve(create_app(settings), settings))


def _use_uvloop() -> None:
    try:
        import uvloop
    except ImportError:
        return
    uvloop.install()


def _serve_workers(settings: Settings) -> int:
    """Several processes share the port via SO_REUSEPORT; signals reach every worker. The run gets a fresh
    folder the workers share: their Prometheus series (merged in any worker's /metrics) and the board
    where one probes the deployments and all post their failures and requests in flight."""
    from gateway.telemetry import metrics

    run_dir = tempfile.mkdtemp(prefix="agent-gateway-")
    os.mkdir(os.path.join(run_dir, "metrics"))
    # Read by prometheus_client when a worker imports it, so set before they are spawned.
    os.environ[metrics.MULTIPROC_DIR_ENV] = os.path.join(run_dir, "metrics")
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=run, args=(replace(settings, worker_index=i, run_dir=run_dir),),
                           name=f"worker-{i}") for i in range(settings.workers)]
    try:
        for worker in workers:
            worker.start()

        def forward(signum: int, _frame: object) -> None:
            for worker in workers:
                if worker.pid is not None and worker.is_alive():
                    os.kill(worker.pid, signum)

        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, forward)
        running = {worker.sentinel: worker for worker in workers}
        while running:
            for sentinel in multiprocessing.connection.wait(list(running)):
                ended = running.pop(sentinel)  # type: ignore[arg-type]  # the sentinels given are ints
                ended.join()
                if ended.pid is not None:
                    metrics.forget_worker(ended.pid)  # its live gauges leave the merged scrape
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return max((w.exitcode or 0) for w in workers)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except FileNotFoundError as exc:
        print(f"agent-gateway: {exc.filename}: no such file", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
