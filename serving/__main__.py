"""`python -m serving`: print or check a profile's exact vLLM commands, or run the pair without a gateway."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from serving import profile as profiles
from serving import tiny_model
from serving.launcher import LaunchError, build_commands, running, validate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serving", description=__doc__)
    parser.add_argument(
        "action",
        choices=["commands", "check", "run"],
        help="commands: print them; check: validate with vLLM's parser; run: start the pair",
    )
    parser.add_argument("profile", nargs="?", default="cpu", help="cpu, gpu or a profile YAML file")
    parser.add_argument("--host", default="127.0.0.1", help="vLLM listen address (default: 127.0.0.1)")
    parser.add_argument("--python", default=sys.executable, help="python that runs vLLM (default: this one)")
    parser.add_argument("--model-dir", type=Path, help="tiny model cache (cpu profile)")
    parser.add_argument("--log-dir", type=Path, default=Path("var/serving"), help="server logs (run)")
    args = parser.parse_args(argv)
    try:
        profile = profiles.load(args.profile)
        model_dir = tiny_model.build(args.model_dir) if profile.uses_tiny_model() else None
        commands = build_commands(profile, model_dir=model_dir, host=args.host, python=args.python)
        if args.action == "commands":
            print("\n".join(f"# {name}\n{cmd.shell()}" for name, cmd in commands.items()))
            return 0
        validate(commands)
        if args.action == "run":
            with running(
                commands,
                args.log_dir,
                start=profile.start,
                timeout_s=profile.startup_timeout_s,
                progress=lambda line: print(line, file=sys.stderr, flush=True),
            ) as servers:
                print("pair ready; Ctrl-C stops it", file=sys.stderr, flush=True)
                _stop_on_sigterm()
                while all(server.exited() is None for server in servers.values()):
                    time.sleep(1.0)
                print("serving: a vLLM server exited; stopping the other", file=sys.stderr)
                return 1
        return 0
    except (profiles.ProfileError, LaunchError) as exc:
        print(f"serving: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


def _stop_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so `running` stops both servers."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


if __name__ == "__main__":
    sys.exit(main())
