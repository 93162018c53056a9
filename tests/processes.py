"""Child processes the tests start (gateway replicas): stopped gently, then surely, by PID."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterable


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
