"""Gateway processes the tests start: on a free loopback port, stopped gently, then surely, by PID."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_gateway(
    policy: Path, port: int, env: Mapping[str, str], *args: str, log: IO[bytes] | None = None
) -> subprocess.Popen[bytes]:
    """`python -m gateway serve` as a child: its output goes to `log`, else stderr is kept in a pipe."""
    argv = [sys.executable, "-m", "gateway", "serve", "--policy", str(policy), "--port", str(port), *args]
    if log is not None:
        return subprocess.Popen(argv, cwd=ROOT, env=dict(env), stdout=log, stderr=log)
    return subprocess.Popen(argv, cwd=ROOT, env=dict(env), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def stop(procs: Iterable[subprocess.Popen[bytes]], grace_s: float = 10.0) -> None:
    """SIGTERM every still-running process, wait up to grace_s each, then SIGKILL the stragglers."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
