"""The processes of a reliability run (fake deployments, gateways, Redis) and its result rows."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.proxy_bench import free_port, wait_ready

ROOT = Path(__file__).resolve().parent.parent
HELLO = [{"role": "user", "content": "hi"}]
POLICY = """\
version: 1
deployments:
  fast:
    url: http://127.0.0.1:{fast}
    served_model: bench
    timeouts: {{connect_s: 1, read_s: 2, total_s: 10}}
    health: {{interval_s: 0.5, timeout_s: 1, eject_after_failures: 100000, cooldown_s: 1}}
  hq:
    url: http://127.0.0.1:{hq}
    served_model: bench
    timeouts: {{connect_s: 1, read_s: 2, total_s: 10}}
    health: {{interval_s: 0.5, timeout_s: 1}}
models:
  auto: {{route: rules}}
default: fast
fallback: [fast, hq]
resume: {{enabled: false}}  # these fakes are not one model family: bench/reliability.py's resume rows have one
"""


@dataclass
class Row:
    fault: str
    requests: int
    expected: str
    observed: str
    ok: bool


@dataclass
class Gateway:
    url: str
    pid: int
    log: Path

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0


class Rig:
    """The processes of one run: fake deployments, gateways, Redis; stopped together, by PID."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, argv: list[str], log: Path | None = None, env: dict[str, str] | None = None) -> int:
        out = log.open("wb") if log else subprocess.DEVNULL
        proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc.pid

    def fakes(self) -> tuple[int, int]:
        fast, hq = free_port(), free_port()
        self.start([sys.executable, "-m", "fakes.openai_upstream", str(fast), "--faults"])
        self.start([sys.executable, "-m", "fakes.openai_upstream", str(hq)])
        wait_ready(fast)
        wait_ready(hq)
        return fast, hq

    def gateway(self, name: str, policy: str, env: dict[str, str]) -> Gateway:
        path = self.folder / f"{name}.yaml"
        path.write_text(policy)
        return self._serving(name, ["gateway", "serve", "--policy", str(path), "--port", "{port}"],
                             {"AGENT_GATEWAY_LOG_LEVEL": "WARNING", **env})

    def minimal_proxy(self, upstream_port: int) -> Gateway:
        """The yardstick (bench/minimal_proxy.py) in front of a deployment, read like a gateway (url, pid, RSS)."""
        return self._serving("minimal-proxy", ["bench.minimal_proxy", "{port}", f"http://127.0.0.1:{upstream_port}"])

    def _serving(self, name: str, module_argv: list[str], env: dict[str, str] | None = None) -> Gateway:
        """`python -m` these arguments ("{port}" in them: a free port), once it listens; its output in name.log."""
        port, log = free_port(), self.folder / f"{name}.log"
        argv = [sys.executable, "-m", *(arg.replace("{port}", str(port)) for arg in module_argv)]
        pid = self.start(argv, log, env)
        wait_ready(port)
        return Gateway(f"http://127.0.0.1:{port}", pid, log)

    def stop(self, pids: Collection[int] | None = None) -> None:
        """Stop these processes (all of the run's when None), by PID: SIGTERM, then SIGKILL after 10 s."""
        procs = [proc for proc in self.procs if pids is None or proc.pid in pids]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


async def gather(count: int, concurrency: int, one: Callable[[int], Awaitable[Any]]) -> list[Any]:
    gate = asyncio.Semaphore(concurrency)

    async def bounded(i: int) -> Any:
        async with gate:
            return await one(i)

    return list(await asyncio.gather(*(bounded(i) for i in range(count))))


async def in_flight(http: aiohttp.ClientSession, gw: Gateway) -> float:
    """Requests the gateway has open at its deployments (gateway_deployment_in_flight, summed)."""
    async with http.get(gw.url + "/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("gateway_deployment_in_flight{"))


async def settled(http: aiohttp.ClientSession, gw: Gateway, timeout_s: float = 10.0) -> bool:
    """Wait (bounded) until the gateway has no request open at a deployment; False when it still has."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if await in_flight(http, gw) == 0:
            return True
        await asyncio.sleep(0.1)
    return False
