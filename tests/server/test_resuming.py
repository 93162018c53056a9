"""A stream that breaks after its first byte is finished by the sibling deployment (issue 21).

Two deterministic fakes of one model family (fakes/greedy_vllm.py: every answer is `w0 w1 ... w11`) stand
in for the pair, so the client's stream can be compared with the uninterrupted answer word for word; the real pair
is killed mid-answer in tests/system/test_e2e_vllm.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer

from fakes.greedy_vllm import ANSWER_WORDS, PROMPT_IDS, Break, GreedyFake, word
from gateway.server.settings import Settings
from tests.fixtures.conditions import until
from tests.fixtures.stack import ADMIN_TOKEN, policy_yaml

WHOLE = "".join(word(i) for i in range(ANSWER_WORDS))
HELLO = [{"role": "user", "content": "hello"}]


class Pair:
    def __init__(self, fast: GreedyFake, hq: GreedyFake, gateway: TestServer) -> None:
        self.fast, self.hq, self.gateway = fast, hq, gateway

    @property
    def base_url(self) -> str:
        return str(self.gateway.make_url("/v1"))

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key="k", max_retries=0)

    async def metrics(self) -> str:
        async with aiohttp.ClientSession() as http, http.get(str(self.gateway.make_url("/metrics"))) as resp:
            return await resp.text()


@pytest.fixture
async def make_pair(
    aiohttp_server: Callable[..., Any], gateway_server: Callable[[Settings], Any], tmp_path: Path
) -> Callable[..., Any]:
    async def make(extra: str = "", settings: dict[str, Any] | None = None, **overrides: str) -> Pair:
        fast, hq = GreedyFake("fake-fast"), GreedyFake("fake-hq")
        fast_url = str((await aiohttp_server(fast.app())).make_url("")).rstrip("/")
        hq_url = str((await aiohttp_server(hq.app())).make_url("")).rstrip("/")
        path = tmp_path / "policy.yaml"
        # The openai SDK runs in this test's event loop, beside the gateway: its first parse of a Responses stream
        # holds the loop for about 0.5 s (more on a loaded machine; asyncio debug shows it), which can take the
        # gateway's connection to hq past the shared test policy's 1 s connect timeout.
        path.write_text(policy_yaml(hq_url, fast_url, extra, connect_s=10, **overrides))
        made = Settings(policy=str(path), admin_token=ADMIN_TOKEN, policy_poll_s=0.1, **(settings or {}))
        return Pair(fast, hq, await gateway_server(made))

    return make


async def _chat_events(pair: Pair, body: dict[str, Any], path: str = "/chat/completions") -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.post(pair.base_url + path, json=body) as resp:
        assert resp.status == 200
        text = await resp.text()
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _text(events: list[dict[str, Any]]) -> str:
    return "".join((c.get("delta") or {}).get("content") or c.get("text") or ""
                   for e in events for c in e.get("choices") or ())


@pytest.mark.parametrize("kind", ["die", "stall", "garbage"])
async def test_a_chat_stream_that_breaks_is_finished_exactly_by_the_sibling(make_pair: Any, kind: str) -> None:
    pair: Pair = await make_pair(read_s="0.5")
    pair.fast.faults.append(Break(after=5, kind=kind))  # the role chunk and four words reach the client
    events = await _chat_events(pair, {"model": "fast", "messages": HELLO, "stream": True, "max_tokens": 50,
                                       "stream_options": {"include_usage": True}})
    assert _text(events) == WHOLE  # nothing repeated, nothing missing
    assert {e["id"] for e in events} == {"chatcmpl-1"} and {e["model"] for e in events} == {"fake-fast"}
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]
    assert finishes == ["stop"]
    assert all("token_ids" not in c for e in events for c in e["choices"]) and "prompt_token_ids" not in events[0]
    usage = [e["usage"] for e in events if e.get("usage")]
    assert usage == [{"prompt_tokens": 5, "completion_tokens": ANSWER_WORDS, "total_tokens": 5 + ANSWER_WORDS}]
    # the sibling was sent the prompt's and the answer's token ids, with the cap less what was generated
    path, sent = pair.hq.received[-1]
    assert path == "/v1/completions"
    assert sent["prompt"] == [*PROMPT_IDS, 100, 101, 102, 103] and sent["max_tokens"] == 46
    assert sent["model"] == "fake-hq"
    assert 'gateway_stream_resumes_total{from="fast",outcome="resumed",to="hq"} 1.0' in await pair.metrics()


async def test_the_openai_sdk_reads_a_resumed_stream_as_one_answer(make_pair: Any) -> None:
    pair: Pair = await make_pair()
    pair.fast.faults.append(Break(after=3))
    async with pair.client() as client:
        stream = await client.chat.completions.create(model="fast", messages=HELLO, stream=True)  # type: ignore[arg-type]
        chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == WHOLE


async def test_a_completions_stream_is_resumed_exactly(make_pair: Any) -> None:
    pair: Pair = await make_pair()
    pair.fast.faults.append(Break(after=6))
    events = await _chat_events(pair, {"model": "fast", "prompt": "say", "stream": True, "max_tokens": 20},
                                path="/completions")
    assert _text(events) == WHOLE
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["stop"]
    assert pair.hq.received[-1][1]["prompt"] == [*PROMPT_IDS, *range(100, 106)]


async def test_a_responses_stream_is_continued_as_one_response(make_pair: Any) -> None:
    pair: Pair = await make_pair()
    pair.fast.faults.append(Break(after=8))  # four opening events, four words
    async with pair.client() as client:
        stream = await client.responses.create(model="fast", input="hello", stream=True)
        seen = [event async for event in stream]
        kinds = [e.type for e in seen]
        assert kinds.count("response.created") == 1 and kinds.count("response.completed") == 1
        assert kinds.count("response.output_item.added") == 1
        numbers = [e.sequence_number for e in seen]
        assert numbers == sorted(set(numbers))  # one numbering, no repeats
        deltas = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
        final = seen[-1].response  # type: ignore[union-attr]
        assert deltas == WHOLE and final.output_text == WHOLE
        assert {e.item_id for e in seen if e.type == "response.output_text.delta"} == {"msg_fake-fast"}
        # by text: the sibling's own count of its part, and the gateway's count of the part before (no token ids)
        assert final.usage is not None and final.usage.output_tokens >= ANSWER_WORDS
        stored = await client.responses.retrieve(final.id)  # the store has the whole answer
        assert stored.output_text == WHOLE
    path, sent = pair.hq.received[-1]
    assert path == "/v1/responses" and sent["input"][-1]["status"] == "incomplete"
    assert sent["input"][-1]["content"][0]["text"] == "".join(word(i) for i in range(4))


@pytest.mark.parametrize(("body", "why"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "n": 2}, "several choices"),
    ({"logprobs": True}, "log probabilities"),
])
async def test_a_stream_that_cannot_be_continued_faithfully_ends_with_the_error_event(
    make_pair: Any, body: dict[str, Any], why: str
) -> None:
    pair: Pair = await make_pair()
    pair.fast.faults.append(Break(after=3))
    events = await _error_stream(pair, {"model": "fast", "messages": HELLO, "stream": True, **body})
    assert "error" in events[-1] and _text(events[:-1]) == word(0) + word(1)
    assert f"not resumed: {why}" in events[-1]["error"]["message"]  # the client's error says why
    assert not pair.hq.received  # no continuation was tried
    assert 'gateway_stream_resumes_total{from="fast",outcome="refused",to="none"} 1.0' in await pair.metrics()
    assert why in _explained_resumes(pair)


def _explained_resumes(pair: Pair) -> str:
    """What the explain memory says about the last request's resumes."""
    from gateway.server.resources import STATE

    recent = pair.gateway.app[STATE].recent
    last = next(reversed(recent._items.values()))  # the newest entry (the API reads by id)
    return " ".join(last.resumes)


async def _error_stream(pair: Pair, body: dict[str, Any]) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.post(pair.base_url + "/chat/completions", json=body) as resp:
        text = await resp.text()
    return [json.loads(e.removeprefix("data: ")) for e in text.split("\n\n") if e.strip() and "[DONE]" not in e]


@pytest.mark.parametrize(("path", "body"), [
    ("/chat/completions", {"messages": HELLO, "stream_options": {"include_usage": True}}),
    ("/chat/completions", {"messages": HELLO}),
    ("/completions", {"prompt": "hello", "stream_options": {"include_usage": True}}),
])
async def test_a_break_after_the_answers_end_is_ended_by_the_gateway_not_an_error(
    make_pair: Any, path: str, body: dict[str, Any]
) -> None:
    """A loaded deployment can send the finish reason and break before its usage chunk and [DONE]: the client has
    the whole answer, so it gets the stream's end (and the usage it asked for), never an error after the answer."""
    pair: Pair = await make_pair()
    pair.fast.faults.append(Break(after=ANSWER_WORDS + 1 + (path == "/chat/completions")))  # after the finish
    events = await _chat_events(pair, {"model": "fast", "stream": True, **body}, path)  # ends with [DONE]
    assert _text(events) == WHOLE and not any("error" in e for e in events)
    assert [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")] == ["stop"]
    usage = [e["usage"] for e in events if e.get("usage")]
    wants_usage = "stream_options" in body
    assert usage == ([{"prompt_tokens": len(PROMPT_IDS), "completion_tokens": ANSWER_WORDS,
                       "total_tokens": len(PROMPT_IDS) + ANSWER_WORDS}] if wants_usage else [])
    assert not pair.hq.received  # nothing to continue
    assert 'gateway_stream_resumes_total{from="fast",outcome="ended",to="none"} 1.0' in await pair.metrics()


async def test_a_stream_that_finds_the_resume_memory_full_is_not_resumed_and_says_so(make_pair: Any) -> None:
    pair: Pair = await make_pair(settings={"resume_memory_bytes": 1})  # no stream's first chunk fits
    pair.fast.faults.append(Break(after=3))
    events = await _error_stream(pair, {"model": "fast", "messages": HELLO, "stream": True})
    assert "error" in events[-1] and _text(events[:-1]) == word(0) + word(1)
    assert "not resumed: the gateway's memory for resumes was full" in events[-1]["error"]["message"]
    assert not pair.hq.received
    assert 'gateway_stream_resumes_total{from="fast",outcome="refused",to="none"} 1.0' in await pair.metrics()


async def test_every_stream_gives_its_transcript_back_to_the_resume_memory(make_pair: Any) -> None:
    from gateway.server.resources import STATE

    pair: Pair = await make_pair()
    memory = pair.gateway.app[STATE].transcripts
    body = {"model": "fast", "messages": HELLO, "stream": True}
    assert _text(await _chat_events(pair, body)) == WHOLE  # whole
    pair.fast.faults.append(Break(after=5))
    assert _text(await _chat_events(pair, body)) == WHOLE  # broken, read back, finished by hq
    pair.fast.faults.append(Break(after=3))
    pair.hq.refuse = True
    assert "error" in (await _error_stream(pair, body))[-1]  # broken, read back, the continuation refused
    async with aiohttp.ClientSession() as http, http.post(pair.base_url + "/chat/completions", json=body) as resp:
        await resp.content.readline()  # the client leaves after the first event
    await until(lambda: memory.held == 0, what="every transcript's bytes given back")


@pytest.mark.parametrize("failed_over", [False, True])
async def test_a_stream_with_no_sibling_to_resume_on_keeps_no_transcript(make_pair: Any, failed_over: bool) -> None:
    """Nothing could finish the stream: one deployment in the order (max_attempts 1), or the last one, failed
    over to before the first byte. The stream keeps no bytes for a resume (nor, with one deployment, asks for
    token ids), and its break says why it is not resumed."""
    from gateway.server.resources import STATE

    pair: Pair = await make_pair("" if failed_over else "max_attempts: 1\n")
    memory = pair.gateway.app[STATE].transcripts
    streaming = pair.hq if failed_over else pair.fast
    pair.fast.refuse = failed_over  # fast answers 500: the call fails over to hq, the last of its order
    streaming.faults.append(Break(after=3, kind="stall"))
    body = {"model": "fast", "messages": HELLO, "stream": True}
    async with aiohttp.ClientSession() as http, http.post(pair.base_url + "/chat/completions", json=body) as resp:
        shown = ""
        while shown != word(0) + word(1):  # the events before the stall: a kept transcript would hold them now
            line = await resp.content.readline()
            assert line, f"the stream ended before the stall, having shown {shown!r}"
            if line.startswith(b"data: {"):
                shown += _text([json.loads(line.strip().removeprefix(b"data: "))])
        assert memory.held == 0
        events = [json.loads(e.strip().removeprefix("data: ")) for e in (await resp.text()).split("\n\n")
                  if e.strip() and "[DONE]" not in e]
    if not failed_over:
        assert "return_token_ids" not in pair.fast.received[-1][1]
        assert not pair.hq.received
    assert "not resumed: no other deployment in the failover order" in events[-1]["error"]["message"]
    which = "hq" if failed_over else "fast"
    assert f'gateway_stream_resumes_total{{from="{which}",outcome="refused",to="none"}} 1.0' in await pair.metrics()


async def test_resume_off_in_the_policy_ends_with_the_error_event(make_pair: Any) -> None:
    pair: Pair = await make_pair("resume: {enabled: false}\n")
    pair.fast.faults.append(Break(after=3))
    events = await _error_stream(pair, {"model": "fast", "messages": HELLO, "stream": True})
    assert "error" in events[-1] and not pair.hq.received


async def test_a_continuation_that_fails_before_its_first_byte_ends_with_the_error_event(make_pair: Any) -> None:
    pair: Pair = await make_pair()
    pair.fast.faults.append(Break(after=3))
    pair.hq.refuse = True
    events = await _error_stream(pair, {"model": "fast", "messages": HELLO, "stream": True})
    assert "error" in events[-1] and _text(events[:-1]) == word(0) + word(1)
    assert 'gateway_stream_resumes_total{from="fast",outcome="failed",to="hq"} 1.0' in await pair.metrics()


def test_a_break_inside_a_tool_call_is_not_resumed() -> None:
    from gateway.server import resume_splice as resume

    chunks = [b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
              b'data: {"id":"c","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":'
              b'{"name":"f","arguments":"{\\"a"}}]}}]}\n\n']
    transcript = resume.Transcript()
    for chunk in chunks:
        transcript.add(chunk)
    progress = resume.read_back("chat", {"messages": HELLO}, transcript, None)
    assert progress.blocked == "the break fell inside a tool call"


async def test_a_second_break_is_resumed_again_up_to_max(make_pair: Any) -> None:
    pair: Pair = await make_pair("resume: {enabled: true, max: 2}\n")
    pair.fast.faults.append(Break(after=3))
    pair.hq.faults.append(Break(after=2))  # the continuation breaks too: back to... no deployment after hq
    events = await _error_stream(pair, {"model": "fast", "messages": HELLO, "stream": True})
    assert "error" in events[-1]
    text = _text(events[:-1])
    assert text == "".join(word(i) for i in range(4))  # two from fast, two from hq, no repeats


async def test_each_part_is_charged_at_its_deployments_price(make_pair: Any) -> None:
    pair: Pair = await make_pair("tenants: [{name: anonymous, budgets: [{window: day, hard_usd: 10}]}]\n")
    pair.fast.faults.append(Break(after=5))
    await _chat_events(pair, {"model": "fast", "messages": HELLO, "stream": True, "max_tokens": 50})
    text = await pair.metrics()
    fast_out = _sample(text, 'gateway_tokens_total{deployment="fast",direction="output"}')
    hq_out = _sample(text, 'gateway_tokens_total{deployment="hq",direction="output"}')
    hq_in = _sample(text, 'gateway_tokens_total{deployment="hq",direction="input"}')
    fast_in = _sample(text, 'gateway_tokens_total{deployment="fast",direction="input"}')
    # exact, from the token ids: fast read the prompt and made four; hq read those too and made the rest
    assert (fast_in, fast_out) == (len(PROMPT_IDS), 4)
    assert (hq_in, hq_out) == (len(PROMPT_IDS) + 4, ANSWER_WORDS - 4)


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in the metrics")


async def test_explain_says_where_the_answer_was_resumed(make_pair: Any) -> None:
    pair: Pair = await make_pair()
    pair.fast.faults.append(Break(after=5))
    async with aiohttp.ClientSession() as http:
        async with http.post(pair.base_url + "/chat/completions",
                             json={"model": "fast", "messages": HELLO, "stream": True}) as resp:
            request_id = resp.headers["x-request-id"]
            await resp.read()
        async with http.get(str(pair.gateway.make_url(f"/admin/requests/{request_id}/explain")),
                            headers={"authorization": f"Bearer {ADMIN_TOKEN}"}) as resp:
            served = (await resp.json())["served"]
    assert served["attempts"] == ["fast", "hq"]
    (resumed,) = served["resumes"]
    assert resumed.startswith("fast -> hq at 4 tokens: resumed")


def test_a_sibling_without_room_for_the_answer_so_far_is_not_sent_it() -> None:
    from types import SimpleNamespace

    from gateway.server import resuming
    from gateway.server.resume_splice import Progress

    policy = SimpleNamespace(deployments={"hq": SimpleNamespace(max_model_len=100)})
    call = SimpleNamespace(policy=policy, body={"messages": HELLO})
    plan = resuming.Plan(None, 1, None, "id", {}, asks_token_ids=True)
    fits = Progress("chat", prompt_ids=[1] * 60, generated_ids=[100] * 30, generated_tokens=30, prompt_tokens=60)
    assert resuming._why_not(call, plan, fits, "hq", 10, "chat") is None  # type: ignore[arg-type]
    full = Progress("chat", prompt_ids=[1] * 60, generated_ids=[100] * 40, generated_tokens=40, prompt_tokens=60)
    why = resuming._why_not(call, plan, full, "hq", 10, "chat")  # type: ignore[arg-type]
    assert why is not None and "no room left in its context window (100 tokens)" in why
    plan.left = 0
    assert resuming._why_not(call, plan, fits, "hq", 10, "chat") == "no resumes left for this request"  # type: ignore[arg-type]


def _split_words(pair: Pair, ids_per_event: int) -> None:
    """Both members' words take two ids (the text comes with the second), `ids_per_event` ids an event."""
    for member in (pair.fast, pair.hq):
        member.ids_per_word, member.ids_per_event = 2, ids_per_event


async def test_a_break_after_held_back_ids_resumes_from_the_text_the_client_has(make_pair: Any) -> None:
    pair: Pair = await make_pair()
    _split_words(pair, ids_per_event=1)
    # role; [100] ""; [101] "w0 "; [102] "" (w1's first id, its text held) and then the break
    pair.fast.faults.append(Break(after=4))
    events = await _chat_events(pair, {"model": "fast", "messages": HELLO, "stream": True,
                                       "stream_options": {"include_usage": True}})
    # handed [100, 101, 102], the sibling would open with the prompt's text and w0 again, as vLLM does
    assert _text(events) == WHOLE
    path, sent = pair.hq.received[-1]
    assert path == "/v1/completions" and sent["prompt"] == [*PROMPT_IDS, 100, 101]
    assert [p for p, _ in pair.hq.received] == ["/v1/completions"]  # one id an event: no need to ask where
    usage = [e["usage"] for e in events if e.get("usage")]
    assert usage[0]["completion_tokens"] == 2 * ANSWER_WORDS


async def test_a_break_after_an_event_of_several_ids_asks_the_sibling_where_the_text_ends(make_pair: Any) -> None:
    pair: Pair = await make_pair()
    _split_words(pair, ids_per_event=3)
    # role; [100, 101, 102] "w0 " (w1's first id held); then the break
    pair.fast.faults.append(Break(after=2))
    events = await _chat_events(pair, {"model": "fast", "messages": HELLO, "stream": True})
    assert _text(events) == WHOLE
    asked = [body["tokens"] for path, body in pair.hq.received if path == "/detokenize"]
    # after 102 the text would end inside w1; after 101 on a whole word (had it not, 100 would be the end, unasked)
    assert asked == [[100, 101, 102], [100, 101]]
    assert pair.hq.received[-1][1]["prompt"] == [*PROMPT_IDS, 100, 101]


async def test_an_event_of_several_ids_that_ends_on_a_whole_word_is_continued_after_all_of_them(
    make_pair: Any,
) -> None:
    pair: Pair = await make_pair()
    _split_words(pair, ids_per_event=3)
    pair.fast.faults.append(Break(after=3))  # role; [100, 101, 102] "w0 "; [103, 104, 105] "w1 w2 "; the break
    events = await _chat_events(pair, {"model": "fast", "messages": HELLO, "stream": True})
    assert _text(events) == WHOLE
    # asked from after a one-id event's text (none here: from the start) to the last event's end
    assert [b["tokens"] for p, b in pair.hq.received if p == "/detokenize"] == [[100, 101, 102, 103, 104, 105]]
    assert pair.hq.received[-1][1]["prompt"] == [*PROMPT_IDS, *range(100, 106)]


async def test_a_sibling_that_cannot_say_where_the_text_ends_is_not_sent_a_guess(make_pair: Any) -> None:
    pair: Pair = await make_pair()
    _split_words(pair, ids_per_event=3)
    pair.hq.detokenizes = False
    pair.fast.faults.append(Break(after=2))
    events = await _error_stream(pair, {"model": "fast", "messages": HELLO, "stream": True})
    assert "error" in events[-1] and _text(events[:-1]) == word(0)
    assert "not resumed: where the client's text ends could not be found" in events[-1]["error"]["message"]
    assert [p for p, _ in pair.hq.received] == ["/detokenize"]  # no continuation was sent
    assert 'gateway_stream_resumes_total{from="fast",outcome="refused",to="none"} 1.0' in await pair.metrics()
    assert "where the client's text ends could not be found: hq answered 404 to /detokenize" in \
        _explained_resumes(pair)
