"""The `up` command: the colocated vLLM pair plus a gateway in front of it, stopped together."""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import yaml

from serving import profile as profiles
from serving.launcher import (
    LaunchError,
    ServerCommand,
    build_commands,
    free_port,
    running,
    stop_groups,
    validate,
)

DEFAULT_STATE_DIR = Path("var/up")
_NODE_BIN = Path(sys.prefix) / "node" / "node_modules" / ".bin"  # where scripts/setup installs the coding agents
GATEWAY_READY_TIMEOUT_S = 60.0
DESCRIPTION = (
    "Start both vLLM deployments of a serving profile, then the gateway with a policy pointing at them. "
    "Ctrl-C or SIGTERM stops everything."
)


class Shutdown(Exception):
    """SIGTERM or SIGHUP arrived: unwind like Ctrl-C so every child is stopped."""


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `up` to the gateway CLI."""
    parser = subparsers.add_parser(
        "up",
        help="start the HQ + fast vLLM pair and the gateway in front of them",
        description=DESCRIPTION,
    )
    add_arguments(parser)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default="cpu", help="cpu, gpu or a profile YAML file (default: cpu)")
    parser.add_argument(
        "--policy",
        help="policy template whose deployments get the started servers' url and served_model "
        "(default: policies/default.yaml)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="gateway listen address (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="gateway port (default: 8080)")
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=DEFAULT_STATE_DIR,
        help=f"logs and the generated policy (default: {DEFAULT_STATE_DIR})",
    )
    parser.add_argument("--model-dir", type=Path, help="where the tiny model is cached (cpu profile)")
    parser.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    """`python -m serving.up`: the same command without the gateway CLI around it."""
    parser = argparse.ArgumentParser(prog="python -m serving.up", description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    return int(args.func(args))


def run(args: argparse.Namespace) -> int:
    """Bring everything up, block until Ctrl-C / SIGTERM or a child dies, stop every child."""
    try:
        profile = profiles.load(args.profile)
    except profiles.ProfileError as exc:
        print(f"up: {exc}", file=sys.stderr)
        return 2
    try:
        commands = prepare(profile, args.model_dir)
        _say("checking engine arguments with vLLM's parser")
        validate(commands)
    except LaunchError as exc:
        print(f"up: {exc}", file=sys.stderr)
        return 2
    with _signals_as_shutdown():
        try:
            return serve(profile, commands, args)
        except LaunchError as exc:
            print(f"up: {exc}", file=sys.stderr)
            return 1
        except (KeyboardInterrupt, Shutdown):
            _say("stopped")
            return 0


def prepare(profile: profiles.Profile, model_dir: Path | None) -> dict[str, ServerCommand]:
    """Server commands: the tiny model built when the profile wants it; free ports on cpu."""
    built = None
    if profile.uses_tiny_model():
        from serving import tiny_model  # numpy: only paid by the cpu profile, not by every CLI start

        started = time.monotonic()
        built = tiny_model.build(model_dir)
        _say(f"tiny model ready in {built} ({time.monotonic() - started:.1f} s)")
    ports = None
    if profile.platform == "cpu":
        # A laptop may already run something on 8001/8002; the policy learns whatever ports we got.
        ports = {name: _port_or_free(dep.port) for name, dep in profile.deployments.items()}
    return build_commands(profile, model_dir=built, ports=ports)


def serve(profile: profiles.Profile, commands: Mapping[str, ServerCommand], args: argparse.Namespace) -> int:
    state_dir: Path = args.state_dir
    state_dir.mkdir(parents=True, exist_ok=True)
    _say(
        f"starting {', '.join(commands)} ({profile.platform}); vLLM takes about a minute to load; "
        f"logs in {state_dir}/"
    )
    with running(
        commands, state_dir, start=profile.start, timeout_s=profile.startup_timeout_s, progress=_say
    ) as servers:
        policy_path = write_policy(args.policy, commands, state_dir / "policy.yaml")
        _say(f"policy written to {policy_path}")
        gateway = start_gateway(policy_path, args.host, args.port, state_dir / "gateway.log")
        try:
            wait_listening(gateway, args.host, args.port, GATEWAY_READY_TIMEOUT_S, state_dir / "gateway.log")
            print_welcome(args.host, args.port, commands)
            children = {"gateway": gateway, **{n: s.process for n, s in servers.items()}}
            return watch(children)
        finally:
            stop_groups([gateway], grace_s=10.0)


def start_gateway(policy_path: Path, host: str, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    """Start the gateway as a child in its own process group (the one place that knows its command line)."""
    argv = [
        sys.executable,
        "-m",
        "gateway",
        "serve",
        "--policy",
        str(policy_path),
        "--host",
        host,
        "--port",
        str(port),
    ]
    log = log_path.open("ab")
    try:
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    finally:
        log.close()  # the child holds its own descriptor


def write_policy(template: str | None, commands: Mapping[str, ServerCommand], out: Path) -> Path:
    """Copy the policy template with each deployment's url, served_model and max_model_len filled in."""
    source = Path(template) if template else _default_policy_path()
    data: dict[str, Any] = yaml.safe_load(source.read_text(encoding="utf-8")) if source else {}
    data = fill_policy(data or {}, commands)
    out.write_text(
        f"# Written by `agent-gateway up` from {source or 'a minimal template'}.\n"
        + yaml.safe_dump(data, sort_keys=False),
        encoding="utf-8",
    )
    return out


def fill_policy(policy: dict[str, Any], commands: Mapping[str, ServerCommand]) -> dict[str, Any]:
    """The policy dict with deployments pointing at the started servers (other settings kept)."""
    deployments = dict(policy.get("deployments") or {})
    for name, cmd in commands.items():
        deployments[name] = {
            **(deployments.get(name) or {}),
            "url": cmd.url,
            "served_model": cmd.served_model,
            "max_model_len": cmd.max_model_len,
        }
    filled = {**policy, "deployments": deployments}
    if not policy:
        names = list(commands)
        filled |= {
            "models": {"auto": {"route": "rules"}, **{n: {"pin": n} for n in names}},
            "default": names[-1],
            "fallback": names[::-1],
        }
    return filled


def _default_policy_path() -> Path | None:
    repo_default = Path(__file__).resolve().parent.parent / "policies" / "default.yaml"
    return repo_default if repo_default.exists() else None


def wait_listening(
    process: subprocess.Popen[bytes], host: str, port: int, timeout_s: float, log_path: Path
) -> None:
    """Wait until the gateway accepts TCP connections; raise LaunchError if it exits first."""
    target = "127.0.0.1" if host in ("0.0.0.0", "") else host
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (code := process.poll()) is not None:
            raise LaunchError(f"gateway exited with code {code}: {_last_line(log_path)} (log: {log_path})")
        try:
            with socket.create_connection((target, port), timeout=1.0):
                return
        except OSError:
            time.sleep(0.3)
    raise LaunchError(f"gateway not listening on {target}:{port} after {timeout_s:.0f} s (log: {log_path})")


def print_welcome(host: str, port: int, commands: Mapping[str, ServerCommand]) -> None:
    base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}/v1"
    lines = [f"gateway: {base}"]
    lines += [f"  {name}: {cmd.url} serves {cmd.served_model!r}" for name, cmd in commands.items()]
    lines += [
        "try:",
        f"  curl -s {base}/chat/completions -H 'content-type: application/json' \\",
        '    -d \'{"model": "auto", "messages": [{"role": "user", "content": "Hello!"}]}\'',
        f"  python -c \"import openai; c = openai.OpenAI(base_url='{base}', api_key='none'); "
        "print(c.chat.completions.create(model='auto', "
        "messages=[{'role': 'user', 'content': 'Hello!'}]).choices[0].message.content)\"",
        f"  ANTHROPIC_BASE_URL={base.removesuffix('/v1')} ANTHROPIC_API_KEY=none {_NODE_BIN / 'claude'} -p "
        "--model auto 'Hello!'",
        f"  Codex: a provider with base_url = \"{base}\" and wire_api = \"responses\" (README: Coding agents)",
        "Ctrl-C stops the gateway and both vLLM servers.",
    ]
    print("\n".join(lines), flush=True)


def watch(children: Mapping[str, subprocess.Popen[bytes] | None]) -> int:
    """Block until a child exits (an error: it should run until we stop it)."""
    while True:
        for name, process in children.items():
            if process is not None and (code := process.poll()) is not None:
                print(f"up: {name} exited with code {code}; stopping the rest", file=sys.stderr)
                return 1
        time.sleep(1.0)


@contextmanager
def _signals_as_shutdown() -> Iterator[None]:
    """Turn SIGTERM/SIGHUP into Shutdown; once unwinding, ignore further signals so cleanup completes."""
    handled = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)

    def unwind(signum: int, frame: FrameType | None) -> None:
        for sig in handled:
            signal.signal(sig, signal.SIG_IGN)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Shutdown(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, unwind) for sig in handled}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _port_or_free(port: int) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return free_port()
    return port


def _last_line(path: Path) -> str:
    """The last non-empty line of a log: for a Python crash, the exception itself."""
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][-300:] if lines else ""


def _say(message: str) -> None:
    print(f"up: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
