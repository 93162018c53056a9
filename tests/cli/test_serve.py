"""`agent-gateway serve` as a real process: single and several workers, clean exit, clear CLI errors."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from tests.fixtures.processes import free_port, spawn_gateway
from tests.fixtures.stack import ADMIN_TOKEN, Stack

HELLO = [{"role": "user", "content": "hi"}]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


async def test_workers_share_the_port_and_stop_together(make_stack: Any) -> None:
    stack: Stack = await make_stack()
    port = free_port()
    proc = spawn_gateway(stack.policy_path, port, {**os.environ, "AGENT_GATEWAY_LOG_LEVEL": "WARNING"},
                         "--workers", "2")
    try:
        deadline = time.monotonic() + 30
        async with aiohttp.ClientSession() as http:
            served = 0
            while served < 20:
                assert time.monotonic() < deadline, "workers did not come up"
                try:
                    async with http.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                         json={"model": "auto", "messages": HELLO}) as resp:
                        assert resp.status == 200
                        served += 1
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.2)
        workers = _children(proc.pid)
        assert len(workers) >= 2
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
    assert proc.returncode == 0
    deadline = time.monotonic() + 10  # multiprocessing's helper process exits a moment after its parent
    while any(_alive(worker) for worker in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [worker for worker in workers if _alive(worker)]


def _alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def test_serve_without_policy_is_a_clear_error(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_GATEWAY_")}
    out = subprocess.run([sys.executable, "-m", "gateway", "serve"], capture_output=True, text=True, env=env)
    assert out.returncode == 2 and "give --policy FILE" in out.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\ndeployments: {}\nmodels: {}\ndefault: x\n")
    out = subprocess.run([sys.executable, "-m", "gateway", "serve", "--policy", str(bad)],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 2 and f"{bad}" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "gateway", "serve", "--policy", str(bad)], capture_output=True,
                         text=True, env={**env, "AGENT_GATEWAY_PORT": "eighty"})
    assert out.returncode == 2 and "AGENT_GATEWAY_PORT='eighty' is not a valid int" in out.stderr


def test_serve_with_a_bad_classifier_model_is_a_clear_error(tmp_path: Path) -> None:
    policy = Path(__file__).resolve().parents[2] / "policies" / "default.yaml"
    model = tmp_path / "model.pkl"
    model.write_bytes(b"\x80\x04K\x01.")
    env = {**os.environ, "AGENT_GATEWAY_CLASSIFIER_MODEL": str(model)}
    out = subprocess.run([sys.executable, "-m", "gateway", "serve", "--policy", str(policy)],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2 and "model.pkl" in out.stderr and "Traceback" not in out.stderr


def _total(exposition: str, family: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in exposition.splitlines()
               if line.startswith(family + "{") or line.startswith(family + " "))


async def _from_each_worker(http: aiohttp.ClientSession, url: str, workers: int, deadline: float,
                            ready: Any = lambda text: True) -> dict[str, str]:
    """The first answer from each worker (named by x-gateway-worker) that `ready` accepts."""
    found: dict[str, str] = {}
    last: dict[str, str] = {}
    while len(found) < workers:
        assert time.monotonic() < deadline, f"accepted answers from workers {sorted(found)} only; last: {last}"
        try:
            async with http.get(url, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}) as resp:
                worker = resp.headers.get("x-gateway-worker") or str((await resp.json())["worker"]["index"])
                text = await resp.text()
        except aiohttp.ClientConnectionError:
            await asyncio.sleep(0.1)
            continue
        last[worker] = text[-2000:]
        if ready(text):
            found.setdefault(worker, text)
    return found


async def test_workers_tell_one_truth_in_metrics_and_deployments(make_stack: Any) -> None:
    """Whichever worker answers, /metrics counts every worker's requests, and every worker reports the same
    health: one worker probes, the others take its figures."""
    stack: Stack = await make_stack()
    policy = stack.policy_path.with_name("slow-probes.yaml")  # a probe a second: answers can agree on it
    policy.write_text(stack.policy_path.read_text().replace("interval_s: 0.2", "interval_s: 1"))
    port = free_port()
    env = {**os.environ, "AGENT_GATEWAY_LOG_LEVEL": "WARNING", "AGENT_GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN}
    proc = spawn_gateway(policy, port, env, "--workers", "2")
    base = f"http://127.0.0.1:{port}"
    requests = 40
    try:
        deadline = time.monotonic() + 60
        # a fresh connection per request: SO_REUSEPORT spreads connections, so both workers serve some
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
            await _from_each_worker(http, base + "/metrics", 2, deadline)
            for _ in range(requests):
                async with http.post(base + "/v1/chat/completions", json={"model": "auto", "messages": HELLO}) as resp:
                    assert resp.status == 200
            scrapes = await _from_each_worker(http, base + "/metrics", 2, deadline,
                                              lambda text: _total(text, "gateway_requests_total") == requests)
            for text in scrapes.values():
                assert _total(text, "gateway_tokens_total") == requests * (11 + 8)
                assert "gateway_deployment_in_flight" in text
            stack.hq.healthy = False
            await _same_probe_from_each_worker(http, base, deadline)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
    assert proc.returncode == 0


async def _same_probe_from_each_worker(http: aiohttp.ClientSession, base: str, deadline: float) -> None:
    """Both workers report hq unhealthy from the very same probe (its time), taken by the one prober."""
    latest: dict[int, dict[str, Any]] = {}
    while True:
        assert time.monotonic() < deadline, f"workers disagree: {latest}"
        async with http.get(base + "/admin/deployments", headers={"authorization": f"Bearer {ADMIN_TOKEN}"}) as r:
            view = await r.json()
        (hq,) = [d for d in view["deployments"] if d["name"] == "hq"]
        latest[view["worker"]["index"]] = {"healthy": hq["healthy"], "probed_at": hq["probed_at"],
                                          "prober": view["worker"]["prober"]}
        if len(latest) == 2 and len({json.dumps(v) for v in latest.values()}) == 1 and not hq["healthy"]:
            return


def _policy_with(tmp_path: Path, extra: str) -> Path:
    policy = tmp_path / "workers.yaml"
    default = Path(__file__).resolve().parents[2] / "policies" / "default.yaml"
    policy.write_text(default.read_text() + extra)
    return policy


def test_workers_without_redis_refuse_a_policy_with_hard_limits(tmp_path: Path) -> None:
    """N workers without Redis each keep their own budgets: a hard limit would hold N times over."""
    tenants = "\ntenants:\n  - name: acme\n    budgets: [{window: day, soft_usd: 1, hard_usd: 5}]\n"
    policy = _policy_with(tmp_path, tenants)
    env = {k: v for k, v in os.environ.items() if k != "AGENT_GATEWAY_REDIS_URL"}
    argv = [sys.executable, "-m", "gateway", "serve", "--policy", str(policy), "--workers", "3", "--port",
            str(free_port())]
    # its own process group: should it start its workers after all, none outlives the test
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 2 and "Traceback" not in stderr
    assert str(policy) in stderr and "tenants[0].budgets[0].hard_usd" in stderr
    assert "up to 3 times" in stderr and "store.redis_url" in stderr


def test_workers_without_redis_warn_of_what_each_keeps_to_itself(tmp_path: Path) -> None:
    policy = _policy_with(tmp_path, "\ntenants:\n  - name: acme\n    budgets: [{window: day, soft_usd: 1}]\n")
    env = {k: v for k, v in os.environ.items() if k != "AGENT_GATEWAY_REDIS_URL"}
    log = tmp_path / "serve.log"
    with log.open("wb") as sink:
        proc = spawn_gateway(policy, free_port(), env, "--workers", "2", log=sink)
        try:
            deadline = time.monotonic() + 60
            while log.read_text().count("listening on") < 2:  # both workers started: it was only a warning
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=15)
    text = log.read_text()
    assert "warning: 2 workers without a shared store" in text and str(policy) in text
