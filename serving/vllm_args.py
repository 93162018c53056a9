"""A script run by the vLLM servers' python: checks engine arguments with vLLM's own parser, answers in JSON.

Input on stdin: {name: [engine args]}. Output on stdout: one line `VALIDATION:{name: [problem, ...]}`.
It imports only vLLM and the standard library, so any python with vLLM installed can run it by path.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import itertools
import json
import sys
from typing import Any, NoReturn

MARKER = "VALIDATION:"


class Rejected(Exception):
    """vLLM's parser called error(): the message names the argument."""


def unknown_flags(args: list[str], known: set[str]) -> list[str]:
    """Flags vLLM does not define; checked exactly because argparse would accept unique abbreviations."""
    problems = []
    for arg in args:
        if not arg.startswith("--"):
            continue
        # vLLM accepts --a_b for --a-b and --json-arg.key value for nested JSON fields.
        flag = "--" + arg.split("=", 1)[0].split(".", 1)[0][2:].replace("_", "-")
        if flag not in known:
            close = difflib.get_close_matches(flag, known, n=1)
            problems.append(
                f"unknown vLLM argument {flag}" + (f" (did you mean {close[0]}?)" if close else "")
            )
    return problems


def speculative_problems(args: list[str], fields: set[str]) -> list[str]:
    """--speculative-config is free-form JSON to the parser; check its keys against SpeculativeConfig."""
    problems = []
    for flag, value in itertools.pairwise(args):
        if flag != "--speculative-config":
            continue
        try:
            config: Any = json.loads(value)
        except ValueError as exc:
            problems.append(f"--speculative-config: not JSON: {exc}")
            continue
        if not isinstance(config, dict):
            problems.append("--speculative-config: must be a JSON object")
            continue
        problems += [f"--speculative-config: unknown key {key!r}" for key in sorted(set(config) - fields)]
    return problems


def main() -> None:
    from vllm.config import SpeculativeConfig
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.launchers.launcher import validate_api_server_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def reject(message: str) -> NoReturn:
        raise Rejected(message)

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm-server"))  # type: ignore[no-untyped-call]
    parser.error = reject  # type: ignore[method-assign]
    known = set(parser._option_string_actions)
    spec_fields = set(SpeculativeConfig.__dataclass_fields__)
    problems: dict[str, list[str]] = {}
    for name, args in json.load(sys.stdin).items():
        found = unknown_flags(args, known) + speculative_problems(args, spec_fields)
        if not found:
            try:
                with contextlib.redirect_stderr(io.StringIO()):
                    parsed = parser.parse_args(args)
                    validate_parsed_serve_args(parsed)
                    # What the server checks before loading: the tool-call and reasoning parsers' names.
                    validate_api_server_args(parsed)  # type: ignore[no-untyped-call]
            except (Rejected, ValueError, TypeError) as exc:
                found.append(str(exc))
            except KeyError as exc:
                found.append(str(exc.args[0]))
            except SystemExit as exc:
                found.append(f"vLLM's parser exited with {exc.code}")
        if found:
            problems[name] = found
    print(MARKER + json.dumps(problems))


if __name__ == "__main__":
    main()
