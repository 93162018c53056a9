"""A private redis-server per test session (free port, tmp dir, no persistence) that tests may restart."""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pong(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server process we own; kill() and restart() keep the port, so clients can reconnect."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [
            REDIS_SERVER,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        args += ["--dir", str(self.workdir), "--logfile", str(self.workdir / "redis.log")]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not _pong(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server did not start on port {self.port}:\n{log}")
            time.sleep(0.02)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def pause(self) -> None:
        """Stop answering without closing sockets: the worst case for a client (a hung server)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)


@contextlib.contextmanager
def running_redis(workdir: Path) -> Iterator[RedisServer]:
    if not Path(REDIS_SERVER).exists():
        pytest.skip("redis-server is missing: run scripts/setup (or apt-get install redis-server)")
    server = RedisServer(workdir)
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                server.proc.send_signal(signal.SIGCONT)
        server.kill()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """Shared by the session's tests; they isolate themselves with a unique key prefix, never FLUSHALL."""
    with running_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of the test's own, for tests that kill, pause or restart it."""
    with running_redis(tmp_path) as server:
        yield server


@pytest.fixture
def key_prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}"
