"""The launcher: a profile becomes exact vLLM server commands, checked by vLLM's parser, run as children."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from serving import vllm_args
from serving.profile import Deployment, Profile, tiny_member

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
Progress = Callable[[str], None]


class LaunchError(Exception):
    """The pair cannot be started: a rejected engine argument, a server that died or never got healthy."""


@dataclass(frozen=True)
class ServerCommand:
    """Everything needed to start one deployment's vLLM server."""

    name: str
    python: str
    engine_args: tuple[str, ...]
    env: Mapping[str, str]
    host: str
    port: int
    served_model: str
    max_model_len: int

    @property
    def argv(self) -> list[str]:
        return [self.python, "-m", SERVER_MODULE, *self.engine_args]

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def shell(self) -> str:
        """The command as one copy-pasteable shell line (env first)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return f"{env} {shlex.join(self.argv)}".strip()


def engine_args(dep: Deployment, model: str, platform: str, host: str, port: int) -> list[str]:
    """vLLM server flags for one deployment."""
    args = [
        "--model",
        model,
        "--served-model-name",
        dep.served_model,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        dep.dtype,
        "--max-model-len",
        str(dep.max_model_len),
    ]
    args.append("--enable-prefix-caching" if dep.prefix_caching else "--no-enable-prefix-caching")
    # the usage then reports the prompt's cached tokens, which the gateway prices at the cached input price
    args.append("--enable-prompt-tokens-details")
    if dep.quantization is not None:
        args += ["--quantization", dep.quantization]
    if dep.speculative is not None:
        args += ["--speculative-config", dep.speculative.to_json()]
    if platform == "gpu":
        args += ["--gpu-memory-utilization", str(dep.share)]
    if dep.max_num_seqs is not None:
        args += ["--max-num-seqs", str(dep.max_num_seqs)]
    if dep.tool_call_parser is not None:
        args += ["--enable-auto-tool-choice", "--tool-call-parser", dep.tool_call_parser]
    return [*args, *dep.extra_args]


def split_cores(shares: Sequence[float], cores: Sequence[int]) -> list[list[int]]:
    """Give each share a contiguous run of cores in proportion, at least one each (overlapping if few)."""
    cores = sorted(cores)
    if len(cores) < len(shares):
        return [[cores[i % len(cores)]] for i in range(len(shares))]
    runs: list[list[int]] = []
    start = 0
    for i, share in enumerate(shares):
        left_for_others = len(shares) - i - 1
        count = max(1, round(share * len(cores)))
        count = min(count, len(cores) - start - left_for_others)
        runs.append(cores[start : start + count])
        start += count
    return runs


def build_commands(
    profile: Profile,
    *,
    model_dir: str | Path | None = None,
    ports: Mapping[str, int] | None = None,
    host: str = "127.0.0.1",
    python: str | None = None,
    cores: Sequence[int] | None = None,
) -> dict[str, ServerCommand]:
    """The server command of each deployment; ports default to the profile's, cores to this process's.

    model_dir is the tiny family's directory (serving.tiny_model.build) when the profile uses it.
    """
    pairs = profile.deployments.items()
    if profile.platform == "cpu":
        available = sorted(cores if cores is not None else os.sched_getaffinity(0))
        core_runs = split_cores([dep.share for _, dep in pairs], available)
    commands = {}
    for i, (name, dep) in enumerate(pairs):
        model = model_path(name, dep, model_dir)
        port = (ports or {}).get(name, dep.port)
        env = {**profile.env, **dep.env}
        if profile.platform == "cpu":
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, core_runs[i])))
        commands[name] = ServerCommand(
            name=name,
            python=python or sys.executable,
            engine_args=tuple(engine_args(dep, model, profile.platform, host, port)),
            env=env,
            host=host,
            port=port,
            served_model=dep.served_model,
            max_model_len=dep.max_model_len,
        )
    return commands


def model_path(name: str, dep: Deployment, model_dir: str | Path | None) -> str:
    """What vLLM's --model gets: the tiny family member's directory, else the profile's model as written."""
    member = tiny_member(dep.model)
    if member is None:
        return dep.model
    if model_dir is None:
        raise LaunchError(f"deployments.{name}.model is {dep.model!r}: build it first (serving.tiny_model)")
    return str(Path(model_dir) / member)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the kernel's pick; a tiny race remains until it is bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def validate(commands: Mapping[str, ServerCommand], timeout_s: float = 180.0) -> None:
    """Check every engine argument with vLLM's own parser (in the servers' python); raise naming the flag."""
    problems = check(commands, timeout_s)
    if problems:
        raise LaunchError("; ".join(f"{name}: {p}" for name, found in problems.items() for p in found))


def check(commands: Mapping[str, ServerCommand], timeout_s: float = 180.0) -> dict[str, list[str]]:
    """The problems vLLM's parser finds in each command's engine arguments (empty when all are valid)."""
    problems: dict[str, list[str]] = {}
    for python in {cmd.python for cmd in commands.values()}:
        batch = {name: list(cmd.engine_args) for name, cmd in commands.items() if cmd.python == python}
        try:
            done = subprocess.run(
                # By path, so the servers' python needs vLLM but not this package (run_path, not `python
                # FILE`: that would put serving/ first on sys.path, where profile.py shadows the stdlib's).
                # Importing vLLM takes ~10 s, so one run checks every command.
                [python, "-c", f"import runpy; runpy.run_path({vllm_args.__file__!r}, run_name='__main__')"],
                input=json.dumps(batch),
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"},
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise LaunchError(f"checking vLLM arguments took over {timeout_s:.0f} s") from exc
        line = next((ln for ln in done.stdout.splitlines() if ln.startswith(vllm_args.MARKER)), None)
        if line is None:
            tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
            raise LaunchError(f"cannot load vLLM's argument parser with {python}: " + " | ".join(tail))
        problems |= json.loads(line.removeprefix(vllm_args.MARKER))
    return problems


@dataclass
class Server:
    """One running vLLM server: a child process leading its own process group."""

    command: ServerCommand
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        assert self.process is not None, "server not started"
        return self.process.pid

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self.started_at = time.monotonic()
        # Own session: a terminal's Ctrl-C reaches only us, and killpg reaches vLLM's engine core too.
        self.process = subprocess.Popen(
            self.command.argv,
            env={**os.environ, **self.command.env},
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(self.command.url + "/health", timeout=timeout_s) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def exited(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def last_log_line(self, width: int = 100) -> str:
        try:
            with self.log_path.open("rb") as log:
                log.seek(max(0, self.log_path.stat().st_size - 4096))
                lines = [ln for ln in log.read().decode(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        # vLLM prefixes every line with process, level, time and source; the message is what helps.
        return lines[-1].rsplit("] ", 1)[-1][:width] if lines else ""

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the whole process group, SIGKILL it after grace_s; safe to call twice."""
        stop_all([self], grace_s)


def stop_all(servers: Sequence[Server], grace_s: float = 20.0) -> None:
    """Stop servers together (see stop_groups) and close their logs."""
    stop_groups([s.process for s in servers if s.process is not None], grace_s)
    for server in servers:
        if server._log is not None:
            server._log.close()
            server._log = None


def stop_groups(processes: Sequence[subprocess.Popen[bytes]], grace_s: float = 20.0) -> None:
    """SIGTERM each child's process group, wait up to grace_s overall, then SIGKILL what is left."""
    for process in processes:
        with _suppress_lookup():
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in processes:
        with suppress(subprocess.TimeoutExpired):
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        # Even after a clean exit, grandchildren (vLLM's engine core) may linger in the group.
        with _suppress_lookup():
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _suppress_lookup() -> suppress:
    # The group is already gone (or was never ours to signal): nothing left to stop.
    return suppress(ProcessLookupError, PermissionError)


def wait_healthy(
    servers: Sequence[Server], timeout_s: float, progress: Progress | None = None, every_s: float = 5.0
) -> None:
    """Block until every server answers /health; raise LaunchError if one exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    last_report = 0.0
    while pending:
        for server in list(pending):
            if server.healthy():
                pending.remove(server)
                if progress:
                    progress(
                        f"{server.command.name}: ready at {server.command.url} "
                        f"after {time.monotonic() - server.started_at:.0f} s"
                    )
            elif (code := server.exited()) is not None:
                raise LaunchError(
                    f"{server.command.name}: vLLM exited with code {code} while starting: "
                    f"{server.last_log_line(300)} (log: {server.log_path})"
                )
        now = time.monotonic()
        if pending and now > deadline:
            names = ", ".join(s.command.name for s in pending)
            logs = pending[0].log_path.parent
            raise LaunchError(f"{names}: not healthy after {timeout_s:.0f} s (logs in {logs})")
        if pending and progress and now - last_report >= every_s:
            last_report = now
            for server in pending:
                progress(
                    f"{server.command.name}: loading ({now - server.started_at:.0f} s) "
                    f"{server.last_log_line(80)}"
                )
        if pending:
            time.sleep(0.5)


@contextmanager
def running(
    commands: Mapping[str, ServerCommand],
    log_dir: Path,
    *,
    start: str = "together",
    timeout_s: float = 600.0,
    progress: Progress | None = None,
    grace_s: float = 20.0,
) -> Iterator[dict[str, Server]]:
    """Start the servers, wait until all are healthy, yield them; stop every one on the way out."""
    servers = {name: Server(cmd, log_dir / f"{name}.log") for name, cmd in commands.items()}
    try:
        for server in servers.values():
            server.start()
            if progress:
                progress(f"{server.command.name}: starting pid {server.pid}: {server.command.shell()}")
            if start == "sequential":
                wait_healthy([server], timeout_s, progress)
        wait_healthy(list(servers.values()), timeout_s, progress)
        yield servers
    finally:
        stop_all(list(servers.values()), grace_s)
