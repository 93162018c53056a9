"""The labeller in the running gateway: shadow pairs become labels off the request path, the judge is bounded,
and what it cannot judge labels nothing. Real aiohttp servers, fake deployments, the openai SDK."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer

from fakes.faulty_vllm import FakeVLLM, Fault
from gateway.server.app import create_app
from gateway.server.settings import Settings
from tests.fixtures.conditions import until
from tests.fixtures.stack import ADMIN_TOKEN, fake_server, metric, policy_yaml, with_deployment

HELLO = [{"role": "user", "content": "hello there"}]


def labels_section(judge: str = "{deployment: judge, timeout_s: 5, rate_per_min: 600}", **more: Any) -> str:
    extra = "".join(f"  {k}: {v}\n" for k, v in more.items())
    return textwrap.dedent("""
        shadows:
          - route: auto
            target: deployment:hq
            percent: 100
            sample_by: random
            max_in_flight: 16
    """) + f"labels:\n  strong: hq\n  weak: fast\n  judge: {judge}\n" + extra


class Labelled:
    """hq, fast and a judge (fake deployments) behind a gateway whose `auto` route is shadowed onto hq."""

    def __init__(self, hq: FakeVLLM, fast: FakeVLLM, judge: FakeVLLM, gateway: TestServer) -> None:
        self.hq, self.fast, self.judge, self.gateway = hq, fast, judge, gateway

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=str(self.gateway.make_url("/v1")), api_key="sk-test", max_retries=0)

    async def ask(self, n: int = 1, content: str = "hello there") -> None:
        async with self.client() as client:
            for _ in range(n):
                await client.chat.completions.create(model="auto", messages=[{"role": "user", "content": content}])

    async def labels(self) -> list[dict[str, Any]]:
        async with (
            aiohttp.ClientSession() as http,
            http.get(self.gateway.make_url("/admin/shadow/labels"),
                     headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as r,
        ):
            assert r.status == 200
            found: list[dict[str, Any]] = await r.json()
            return found

    async def metric(self, name: str, **labels: str) -> float:
        return await metric(self.gateway, name, **labels)


@pytest.fixture
async def make_labelled(aiohttp_server: Callable[..., Any], tmp_path: Path) -> Callable[..., Any]:
    async def make(extra: str, judge_answer: str = "TIE", **settings: Any) -> Labelled:
        hq, fast = FakeVLLM("fake-hq"), FakeVLLM("fake-fast")
        judge = FakeVLLM("fake-judge", answer=lambda body: judge_answer)
        urls = [await fake_server(f, aiohttp_server) for f in (hq, fast, judge)]
        path = tmp_path / "policy.yaml"
        path.write_text(with_deployment(policy_yaml(urls[0], urls[1], extra), "judge", urls[2], "fake-judge"))
        cfg = Settings(policy=str(path), admin_token=ADMIN_TOKEN, policy_poll_s=0.1, **settings)
        return Labelled(hq, fast, judge, await aiohttp_server(create_app(cfg)))

    return make


@pytest.mark.parametrize("prompts", [0, 1])
async def test_judged_pairs_become_labels_with_prompts_only_on_opt_in(
    make_labelled: Callable[..., Any], prompts: int
) -> None:
    setup = await make_labelled(labels_section(), request_log_prompts=prompts)
    await setup.ask(3)
    labels = await until(lambda: _at_least(setup, 3))
    label = labels[0]
    assert (label["strong"], label["weak"], label["verdict"], label["source"]) == ("hq", "fast", "tie", "judge")
    assert label["good_enough"] is True and (label["q_strong"], label["q_weak"]) == (1.0, 1.0)
    assert label["agreement"]["exact"] is True and label["features"]["prompt_tokens"] > 0
    assert ("body" in label) is bool(prompts)
    assert ("last_user_text" in label["features"]) is bool(prompts)
    assert "hello there" in json.dumps(labels) if prompts else "hello there" not in json.dumps(labels)
    asked = setup.judge.received[0]
    assert asked["max_tokens"] == 4 and asked["temperature"] == 0
    assert setup.judge.headers_seen[0].get("x-gateway-judge") == "1"
    assert "user: hello there" in asked["messages"][1]["content"]
    assert await setup.metric("gateway_labels_total", verdict="tie") == 3
    assert await setup.metric("gateway_judge_calls_total", result="ok") == 3


async def _at_least(setup: Labelled, n: int) -> list[dict[str, Any]] | None:
    found = await setup.labels()
    return found if len(found) >= n else None


async def test_a_pair_with_a_failed_side_is_no_label(make_labelled: Callable[..., Any]) -> None:
    setup = await make_labelled(labels_section())
    setup.hq.faults = [Fault(status=500)]  # the shadow (the strong side) fails
    await setup.ask(1)
    await until(lambda: setup.metric("gateway_labels_skipped_total", reason="failed_side"))
    assert await setup.labels() == [] and setup.judge.received == []


@pytest.mark.parametrize(
    ("fault", "answer", "result"),
    [(Fault(stall_s=2.0), "TIE", "timeout"), (None, "Both answers look fine to me.", "unparsed"),
     (Fault(status=503), "TIE", "error")],
)
async def test_a_judge_that_times_out_fails_or_answers_garbage_labels_nothing(
    make_labelled: Callable[..., Any], fault: Fault | None, answer: str, result: str
) -> None:
    setup = await make_labelled(labels_section("{deployment: judge, timeout_s: 0.3}"), judge_answer=answer)
    setup.judge.faults = [fault] if fault else []
    await setup.ask(1)
    await until(lambda: setup.metric("gateway_judge_calls_total", result=result))
    assert await setup.metric("gateway_labels_skipped_total", reason="judge") == 1
    assert await setup.labels() == []


async def test_the_judge_is_bounded_in_rate(make_labelled: Callable[..., Any]) -> None:
    setup = await make_labelled(labels_section("{deployment: judge, rate_per_min: 1}"))
    await setup.ask(3)
    await until(lambda: _metric_is(setup, 2.0, "gateway_judge_calls_total", result="rate_limited"))
    assert len(setup.judge.received) == 1 and len(await setup.labels()) == 1


async def _metric_is(setup: Labelled, value: float, name: str, **labels: str) -> bool:
    return await setup.metric(name, **labels) == value


async def test_labelling_never_delays_a_client(make_labelled: Callable[..., Any]) -> None:
    setup = await make_labelled(labels_section("{deployment: judge, timeout_s: 30, max_in_flight: 1}", queue=1))
    setup.judge.faults = [Fault(stall_s=10.0) for _ in range(10)]
    await setup.ask(1)
    await until(lambda: _judging(setup))  # the first pair's judge call is now pending
    await setup.ask(4)  # answered while the judge still stalls; the labeller's queue (1) overflows
    assert setup.judge.in_flight == 1 and await setup.labels() == []
    assert await setup.metric("gateway_labeller_dropped_total") >= 1
    assert len(setup.fast.received) == 5 and len(setup.hq.received) == 5  # every client call and shadow ran


async def _judging(setup: Labelled) -> bool:
    return setup.judge.in_flight == 1


async def test_without_a_judge_the_agreement_labels(make_labelled: Callable[..., Any]) -> None:
    setup = await make_labelled(labels_section("null"))
    setup.fast.answer = lambda body: "The answer is 41."
    setup.hq.answer = lambda body: "The answer is 42."
    await setup.ask(1, "What is 17 + 25?")
    (label,) = await until(lambda: _at_least(setup, 1))
    assert (label["verdict"], label["source"], label["agreement"]["numeric"]) == ("weak_worse", "agreement", False)
    assert (label["q_strong"], label["q_weak"]) == (1.0, 0.0)


HUGE = Fault(body=b'{"choices": [' + b" " * (64 * 1024), repeat=1024)  # 64 MiB that never end the object


async def test_a_judge_that_answers_without_end_is_cut_off_at_the_bound(make_labelled: Callable[..., Any]) -> None:
    """The judge's answer is read through the one bounded call path: cut off at JUDGE_MAX_BODY_BYTES, never
    read whole (reply.read() took all 64 MiB before)."""
    from gateway.experiments.labeller import JUDGE_MAX_BODY_BYTES

    setup = await make_labelled(labels_section())
    setup.judge.faults = [HUGE]
    await setup.ask(1)
    await until(lambda: setup.metric("gateway_judge_calls_total", result="error"))
    assert await setup.labels() == []
    assert setup.judge.body_bytes_sent < JUDGE_MAX_BODY_BYTES + 8 * 1024 * 1024  # the bound, plus socket buffers


async def test_a_shadow_that_answers_without_end_is_cut_off_at_the_bound(make_labelled: Callable[..., Any]) -> None:
    from gateway.experiments.shadows import SHADOW_MAX_BODY_BYTES

    setup = await make_labelled(labels_section())
    setup.hq.faults = [HUGE]  # hq is the shadow target; the client's call goes to fast
    await setup.ask(1)
    await until(lambda: setup.metric("gateway_shadow_requests_total", target="deployment:hq", result="error"))
    assert len(setup.fast.received) == 1
    assert setup.hq.body_bytes_sent < SHADOW_MAX_BODY_BYTES + 8 * 1024 * 1024
