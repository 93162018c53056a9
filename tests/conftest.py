"""Shared fixtures: fake deployments on real aiohttp servers, a policy pointing at them, the gateway."""

from __future__ import annotations

import os
import textwrap
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp.test_utils import TestServer

from gateway.app import create_app
from gateway.settings import Settings
from tests.fakes.fake_vllm import FakeVLLM

ADMIN_TOKEN = "test-admin-token"


def policy_yaml(hq_url: str, fast_url: str, extra: str = "", **overrides: str) -> str:
    """A small policy over two deployments; `extra` is appended verbatim (more rules, sections)."""
    rules = overrides.get("rules", """
        rules:
          - name: tools-to-hq
            when: {tools: true}
            use: hq
          - name: long-to-hq
            when: {prompt_tokens: {gte: 2000}}
            use: hq
          - name: priority-header
            when: {headers: {x-priority: high}}
            use: hq
    """)
    return textwrap.dedent(f"""
        version: 1
        deployments:
          hq:
            url: {hq_url}
            served_model: fake-hq
            price: {{input_per_mtok_usd: 3, output_per_mtok_usd: 15}}
            timeouts: {{connect_s: 1, read_s: {overrides.get("read_s", "5")}, total_s: 10}}
            health: {{interval_s: 0.2, timeout_s: 2, eject_after_failures: 2, cooldown_s: 1}}
            load: {{scrape_interval_s: 0.1}}
          fast:
            url: {fast_url}
            served_model: fake-fast
            endpoints: [chat, completions, embeddings]
            price: {{input_per_mtok_usd: 0.5, output_per_mtok_usd: 1.5}}
            timeouts: {{connect_s: 1, read_s: {overrides.get("read_s", "5")}, total_s: 10}}
            health: {{interval_s: 0.2, timeout_s: 2, eject_after_failures: 2, cooldown_s: 1}}
            load: {{spill_when_waiting_gte: 8, spill_to: hq, scrape_interval_s: 0.1}}
        models:
          auto: {{route: rules}}
          hq: {{pin: hq}}
          fast: {{pin: fast}}
    """) + textwrap.dedent(rules) + textwrap.dedent("""
        default: fast
        fallback: [fast, hq]
    """) + textwrap.dedent(extra)


class Stack:
    """Two fake deployments and a gateway in front, all real aiohttp servers on free ports."""

    def __init__(self, hq: FakeVLLM, fast: FakeVLLM, gateway: TestServer, policy_path: Path) -> None:
        self.hq, self.fast, self.gateway, self.policy_path = hq, fast, gateway, policy_path

    @property
    def base_url(self) -> str:
        return str(self.gateway.make_url("/v1"))

    def client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key="sk-client-secret", max_retries=0, **kwargs)


@pytest.fixture
async def fake_pair(
    aiohttp_server: Callable[..., Any],
) -> AsyncIterator[tuple[FakeVLLM, TestServer, FakeVLLM, TestServer]]:
    hq, fast = FakeVLLM("fake-hq"), FakeVLLM("fake-fast")
    hq_server = await aiohttp_server(hq.app())
    fast_server = await aiohttp_server(fast.app())
    yield hq, hq_server, fast, fast_server


@pytest.fixture
async def make_stack(
    fake_pair: Any, aiohttp_server: Callable[..., Any], tmp_path: Path
) -> Callable[..., Any]:
    hq, hq_server, fast, fast_server = fake_pair

    async def make(extra: str = "", settings: dict[str, Any] | None = None, **overrides: str) -> Stack:
        path = tmp_path / "policy.yaml"
        path.write_text(policy_yaml(str(hq_server.make_url("")).rstrip("/"),
                                    str(fast_server.make_url("")).rstrip("/"), extra, **overrides))
        cfg = Settings(policy=str(path), admin_token=ADMIN_TOKEN, policy_poll_s=0.1, **(settings or {}))
        gateway = await aiohttp_server(create_app(cfg))
        return Stack(hq, fast, gateway, path)

    return make


@pytest.fixture
async def stack(make_stack: Callable[..., Any]) -> Stack:
    result: Stack = await make_stack()
    return result


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """In CI a skipped test is a failure: a missing component (vllm, redis-server) must be installed."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") == "true" and report.skipped:
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, which must install everything: {report.longrepr}"
