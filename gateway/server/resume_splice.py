"""Finishing a broken stream on the sibling deployment: what was streamed, the continuation's request, and its
events spliced into the client's stream as one answer.

The two deployments are one model family (one tokenizer, one chat template), so the answer so far can be handed
to the sibling as the start of the answer to continue:

- exactly, as token ids, where the deployment returned them (vLLM's `return_token_ids` on chat and completions):
  the prompt's ids and the ids generated so far become the prompt of the sibling's `/v1/completions`, so at
  temperature 0 the continuation is the answer the first deployment would have given;
- as text otherwise: chat's final assistant message continued (`continue_final_message`), a completions prompt
  followed by its text, a Responses input ending in the partial assistant message (`status: incomplete`, which
  vLLM continues). A valid continuation, equal only where the text re-tokenizes as it was generated.

Where a continuation would not be faithful, `Progress.blocked` says why and the stream ends with the API's error
event as before: a tool call (or reasoning) begun, several choices, log probabilities, an answer already finished,
one too long to read back, or an API whose deployment cannot continue a partial answer (vLLM's Messages API).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.apis import events, json_body
from gateway.apis.chat import wire as chat_wire
from gateway.apis.responses import wire as responses
from gateway.apis.routes import RESUMABLE
from gateway.apis.usage import Usage

# The token ids vLLM adds to each streamed chunk when asked (and the prompt's, to the first): the gateway asks
# for them to resume exactly and takes them out before the client sees the chunk (unless it asked itself).
_TOKEN_IDS = re.compile(rb',\s*"(?:prompt_)?token_ids"\s*:\s*(?:\[[0-9,\s]*\]|null)')
# An answer longer than this (its stream's bytes) is not read back to resume: it ends with the error event.
MAX_TRANSCRIPT_BYTES = 8 * 1024 * 1024
# Sampling fields a chat or completions request carries over to the sibling's /v1/completions.
_SAMPLING = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "include_stop_str_in_output", "logit_bias", "bad_words", "allowed_token_ids",
    "user",
)
# What makes a text continuation of chat unfaithful at the token level: its tool and format parsing is the
# chat endpoint's, not the completions endpoint's.
_CHAT_PARSED = ("tools", "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                "guided_grammar")


def strip_token_ids(chunk: bytes) -> bytes:
    """A streamed chunk without the token ids the gateway asked for."""
    return _TOKEN_IDS.sub(b"", chunk) if b"token_ids" in chunk else chunk


def before_error(chunk: bytes) -> tuple[bytes, bool]:
    """A chunk's events up to a deployment's own error event (`data: {"error": ...}`), and whether one came."""
    found, _ = chat_wire.split_events(chunk)
    for n, event in enumerate(found):
        data = chat_wire.event_data(event)
        if isinstance(data, dict) and "error" in data and "choices" not in data:
            return b"".join(found[:n]), True
    return chunk, False


@dataclass(slots=True)
class Progress:
    """What the client has been sent of one answer, across every part: the base a continuation starts from."""

    api: str
    answer_id: str = ""  # the names the client saw first; every continuation speaks under them
    created: int = 0
    model: str = ""
    text: list[str] = field(default_factory=list)
    prompt_ids: list[int] | None = None  # None: the deployment did not return token ids (resume by text)
    generated_ids: list[int] = field(default_factory=list)
    generated_tokens: int = 0  # the ids' count, else an estimate from the text
    prompt_tokens: int = 0  # the client's prompt as the first deployment counted it (0: not known)
    blocked: str | None = None  # why the answer cannot be continued faithfully
    finished: bool = False  # the answer's own end (a finish reason, a terminal event) reached the client
    charged_tokens: int = 0  # generated tokens already charged to the parts before
    # the Responses API: the output message being written, and the last event's sequence number
    item: dict[str, Any] = field(default_factory=dict)
    sequence: int = -1
    # Where the client's text ends among the generated ids. A deployment's detokenizer holds back the text of
    # ids that end inside a character (or on an invalid byte) until later ids complete it, so the ids streamed
    # can run past the text sent: `shown` is the ids of the last event that carried text, and `boundary` the
    # ids up to the end of the last one-id event with text, a point where the decoded text is known to end on
    # a whole character.
    shown: tuple[int, int] = (0, 0)
    boundary: int = 0

    @property
    def exact(self) -> bool:
        return self.prompt_ids is not None and self.api in ("chat", "completions")

    def part_usage(self) -> Usage:
        """What the part that just broke cost: its deployment read the prompt and the answer before this part,
        and generated what the answer grew by since; the next part starts from here."""
        usage = Usage(self.prompt_tokens + self.charged_tokens, self.generated_tokens - self.charged_tokens,
                             estimated=not self.exact)
        self.charged_tokens = self.generated_tokens
        return usage

    def block(self, why: str) -> None:
        self.blocked = self.blocked or why

    def finish(self) -> None:
        """The answer ended as its API ends one: nothing is left to continue, only the stream's end to send."""
        self.finished = True
        self.block("the answer had already finished")

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """A chunk of the client's API (chat or completions) under the first part's id, creation time and model."""
        kind = "text_completion" if self.api == "completions" else "chat.completion.chunk"
        return {"id": self.answer_id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def usage_event(self, usage: Usage) -> bytes:
        """The stream's usage chunk, as chat and completions end a stream that asked for it."""
        chunk = {**self.chunk([]), "usage": {
            "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}}
        return b"data: " + json_body.encode(chunk) + b"\n\n"

    def took(self, ids: list[int], text: str) -> None:
        """One event's generated ids and the text it carried to the client."""
        start = len(self.generated_ids)
        self.generated_ids += ids
        if ids and text:
            self.shown = (start, len(self.generated_ids))
            if len(ids) == 1:  # its detokenizer let the text out after this id: a whole character ends here
                self.boundary = len(self.generated_ids)

    def shown_ends(self) -> list[int]:
        """Where the ids whose text the client has may end, latest first. The ids after the last event with text
        are held-back bytes, so never; within that event, after any of its ids when it carried several (the
        last one's text may be held); after its one id when it carried one."""
        start, end = self.shown
        return list(range(end, start, -1)) if end - start > 1 else [end]

    def keep_shown(self, count: int) -> None:
        """Continue from the first `count` generated ids: the client has their text, and none of the rest's.
        The sibling generates the rest again (at temperature 0, the same ids), and is charged for them."""
        del self.generated_ids[count:]
        self.generated_tokens = count
        self.shown, self.boundary = (count, count), count  # the client's text ends exactly here now


def blocked_by_request(api: str, body: Mapping[str, Any]) -> str | None:
    """Why a request's answer cannot be resumed whatever is streamed (None: it may be)."""
    if api == "messages":
        return "the Messages API: vLLM cannot continue a partial message"
    if api not in RESUMABLE:
        return f"the {api} API is not streamed"
    if chat_wire.choices_of(body, api) > 1:
        return "several choices (n > 1)"
    if body.get("logprobs") or body.get("top_logprobs"):
        return "log probabilities were asked for"
    if api == "completions" and (body.get("echo") or body.get("suffix") is not None):
        return "echo or suffix was asked for"
    if api == "responses" and body.get("background"):
        return "a background response"
    return None


class TranscriptMemory:
    """The stream bytes every transcript of the process holds together, at most `max_bytes`: a stream's own limit
    bounds one stream, and this bounds them all, where many clients reading long streams slowly would each hold
    up to MAX_TRANSCRIPT_BYTES. A stream that finds it full is not resumed (its break ends with the error event,
    as before resumption); the streams already kept stay resumable."""

    __slots__ = ("held", "max_bytes")

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.held = max_bytes, 0

    def take(self, size: int) -> bool:
        if self.held + size > self.max_bytes:
            return False
        self.held += size
        return True

    def give_back(self, size: int) -> None:
        self.held -= size


TOO_LONG = "the answer is too long to read back"
MEMORY_FULL = "the gateway's memory for resumes was full (AGENT_GATEWAY_RESUME_MEMORY_BYTES)"


class Transcript:
    """A stream's bytes as the deployment sent them, kept for a resume to read back; past MAX_TRANSCRIPT_BYTES, or
    where the process's `memory` for transcripts is full, it lets them go (a resume is then refused, `why_not` says
    why), so a long stream costs no more memory than a short one's limit. `release` gives its bytes back to the
    memory (the stream ended, or a resume read them back)."""

    __slots__ = ("chunks", "memory", "size", "why_not")

    def __init__(self, memory: TranscriptMemory | None = None) -> None:
        self.chunks: list[bytes] = []
        self.size = 0  # the bytes held (taken from the memory)
        self.memory = memory
        self.why_not: str | None = None

    @property
    def whole(self) -> bool:
        return self.why_not is None

    def add(self, chunk: bytes) -> None:
        if self.why_not is not None:
            return
        if self.size + len(chunk) > MAX_TRANSCRIPT_BYTES:
            self._let_go(TOO_LONG)
        elif self.memory is not None and not self.memory.take(len(chunk)):
            self._let_go(MEMORY_FULL)
        else:
            self.chunks.append(chunk)
            self.size += len(chunk)

    def release(self) -> None:
        if self.memory is not None:
            self.memory.give_back(self.size)
        self.chunks, self.size = [], 0

    def _let_go(self, why: str) -> None:
        self.release()
        self.why_not = why


def read_back(api: str, body: Mapping[str, Any], transcript: Transcript | None, blocked: str | None) -> Progress:
    """What the client was sent, read from the stream's bytes as the deployment sent them (token ids included)."""
    progress = Progress(api, blocked=blocked)
    if blocked is not None:
        return progress
    why_not = TOO_LONG if transcript is None else transcript.why_not
    if why_not is not None:
        progress.block(why_not)
        return progress
    assert transcript is not None
    streamed, _ = chat_wire.split_events(b"".join(transcript.chunks))
    if api == "responses":
        for event in streamed:
            _read_responses_event(progress, event)
    else:
        progress.prompt_ids = []
        for event in streamed:
            _read_openai_event(progress, event)
        if progress.prompt_ids == [] or (not progress.generated_ids and progress.text):
            progress.prompt_ids = None  # no token ids came: continue by text
        if api == "chat" and progress.prompt_ids is not None and any(body.get(k) for k in _CHAT_PARSED):
            progress.prompt_ids = None  # tools and formats are parsed by the chat endpoint: continue there
    progress.generated_tokens = len(progress.generated_ids) if progress.exact else 0
    return progress


def _read_openai_event(progress: Progress, event: bytes) -> None:
    data = chat_wire.event_data(event)
    if not isinstance(data, dict):
        return
    if not progress.answer_id:
        progress.answer_id, progress.created, progress.model = _text(data, "id"), _number(data, "created"), \
            _text(data, "model")
    if progress.prompt_ids is not None and isinstance(data.get("prompt_token_ids"), list):
        progress.prompt_ids = [i for i in data["prompt_token_ids"] if isinstance(i, int)]
    usage = chat_wire.usage_of(data)
    if usage is not None and usage.prompt_tokens:
        progress.prompt_tokens = usage.prompt_tokens
    for choice in data.get("choices") or ():
        if isinstance(choice, dict):
            _read_choice(progress, choice)


def _read_choice(progress: Progress, choice: dict[str, Any]) -> None:
    if choice.get("finish_reason") is not None:
        progress.finish()
    delta = choice.get("delta")
    if isinstance(delta, dict):
        if delta.get("tool_calls") or delta.get("function_call"):
            progress.block("the break fell inside a tool call")
        if delta.get("reasoning") or delta.get("reasoning_content"):
            progress.block("the answer was reasoning")
        text = delta.get("content")
    else:
        text = choice.get("text")
    text = text if isinstance(text, str) else ""
    if text:
        progress.text.append(text)
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        progress.took([i for i in ids if isinstance(i, int)], text)


def _read_responses_event(progress: Progress, event: bytes) -> None:
    kind = events.event_type(event)
    data = events.data_of(event)
    if isinstance(data.get("sequence_number"), int):
        progress.sequence = data["sequence_number"]
    if kind == b"response.created":
        response = data.get("response")
        if isinstance(response, dict):
            progress.model, progress.created = _text(response, "model"), _number(response, "created_at")
    elif kind == b"response.output_item.added":
        item = data.get("item")
        if not isinstance(item, dict) or item.get("type") != "message" or progress.item:
            progress.block("the answer was not one message (a tool call or reasoning begun)")
        else:
            progress.item = {"id": item.get("id"), "output_index": data.get("output_index", 0), "content_index": 0}
    elif kind == b"response.output_text.delta" and isinstance(data.get("delta"), str):
        progress.text.append(data["delta"])
        progress.item["content_index"] = data.get("content_index", 0)
    elif kind in (b"response.output_item.done", b"response.completed", b"response.incomplete"):
        progress.finish()
    elif kind == b"response.content_part.added" and progress.item.get("parts_seen"):
        progress.block("the answer had several content parts")
    if kind == b"response.content_part.added" and progress.item:
        progress.item["parts_seen"] = True


def output_cap(api: str, body: Mapping[str, Any], cap_tokens: int | None) -> int | None:
    """What the request may generate in all: the gateway's cap, else the request's own (None: not given)."""
    if cap_tokens is not None:
        return cap_tokens
    if api == "responses":
        found = body.get("max_output_tokens")
        return found if isinstance(found, int) else None
    return chat_wire.output_cap(body, api)


def continuation(
    progress: Progress, body: Mapping[str, Any], served_model: str, remaining_tokens: int
) -> tuple[str, bytes]:
    """The sibling's request (its path and body) that continues the answer with at most `remaining_tokens`."""
    if progress.exact:
        return "/v1/completions", json_body.encode(_token_continuation(progress, body, served_model, remaining_tokens))
    text = "".join(progress.text)
    out = dict(body)
    out["model"], out["stream"] = served_model, True
    if progress.api == "responses":
        items = body.get("input")
        given = [{"role": "user", "content": items}] if isinstance(items, str) else list(items or [])
        partial = {"type": "message", "role": "assistant", "status": "incomplete",
                   "content": [{"type": "output_text", "text": text}]}
        out.update(input=[*given, partial], max_output_tokens=remaining_tokens, store=False)
        out.pop("previous_response_id", None)
        return "/v1/responses", json_body.encode(out)
    out["stream_options"] = {"include_usage": True}
    if progress.api == "completions":
        out.update(prompt=body.get("prompt", "") + text, max_tokens=remaining_tokens)
        return "/v1/completions", json_body.encode(out)
    out.pop("max_completion_tokens", None)
    messages = list(body.get("messages") or ())
    out.update(messages=[*messages, {"role": "assistant", "content": text}], max_tokens=remaining_tokens,
               continue_final_message=True, add_generation_prompt=False)
    return "/v1/chat/completions", json_body.encode(out)


def _token_continuation(
    progress: Progress, body: Mapping[str, Any], served_model: str, remaining: int
) -> dict[str, Any]:
    assert progress.prompt_ids is not None
    out: dict[str, Any] = {k: body[k] for k in _SAMPLING if k in body}
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int) and min_tokens > progress.generated_tokens:
        out["min_tokens"] = min_tokens - progress.generated_tokens
    out.update(model=served_model, prompt=[*progress.prompt_ids, *progress.generated_ids], max_tokens=remaining,
               stream=True, stream_options={"include_usage": True}, return_token_ids=True)
    return out


# vLLM's route that decodes token ids to text with the model's tokenizer (the sibling's is the family's)
DETOKENIZE_PATH = "/detokenize"


def detokenize_body(progress: Progress, end: int, served_model: str) -> bytes:
    """The request that decodes the generated ids from the last known character boundary up to `end`."""
    return json_body.encode({"model": served_model, "tokens": progress.generated_ids[progress.boundary:end]})


def ends_on_character(body: bytes) -> bool | None:
    """Whether a detokenize answer's text ends on a whole character, not on bytes a detokenizer holds back
    (the replacement character, U+FFFD); None when the body is not a detokenize answer."""
    found = json_body.response_object(body)
    text = found.get("prompt") if found is not None else None
    return not text.endswith("\ufffd") if isinstance(text, str) else None


def resumable_text(api: str, body: Mapping[str, Any]) -> bool:
    """A text continuation needs the request's prompt as a string (completions) or messages (chat)."""
    if api == "completions":
        return isinstance(body.get("prompt"), str)
    if api == "chat":
        return isinstance(body.get("messages"), list)
    return api == "responses"


class Splice:
    """The sibling's continuation stream, turned into the client's stream of the first part: the same id, model
    and item, no second role or opening events, one finish, and one final usage over both parts. It also
    extends `progress`, so a break in the continuation can be resumed again from the whole answer so far."""

    def __init__(self, progress: Progress, client_wants_usage: bool, first_part_tokens: int,
                 text_of: Callable[[bytes], str] | None = None) -> None:
        self.progress = progress
        self.client_wants_usage = client_wants_usage
        self.before = first_part_tokens  # generated by the earlier parts (what the client's usage adds)
        self._pending = b""
        self.done = False
        self.error = False  # a continuation's error chunk is found by the relay itself (before_error)
        self.usage: Usage | None = None  # the continuation's own (charged at the sibling's price)
        self.streamed = chat_wire.StreamTally(text_of)  # what it generated, should its usage never come
        self.final: dict[str, Any] | None = None  # the Responses API's whole answer, for the store

    def answer_view(self) -> dict[str, Any] | None:
        """The whole answer as a chat completion for the agent step (chat's step reads the relayed chunks)."""
        if self.progress.api != "responses":
            return None
        return events.answer_view("".join(self.progress.text), [])

    def feed(self, chunk: bytes) -> bytes:
        self.streamed.add(chunk)
        found, self._pending = chat_wire.split_events(self._pending + chunk)
        out = [self._event(event) for event in found]
        return b"".join(e for e in out if e)

    def _event(self, event: bytes) -> bytes:
        if self.progress.api == "responses":
            return self._responses_event(event)
        if event.startswith(chat_wire.DONE_EVENT):
            self.done = True
            return chat_wire.DONE_EVENT
        data = chat_wire.event_data(event)
        if not isinstance(data, dict):
            return b""
        own = chat_wire.usage_of(data)
        if own is not None and not data.get("choices"):
            self.usage = own
            return self._usage_chunk() if self.client_wants_usage else b""
        choices = [c for c in data.get("choices") or () if isinstance(c, dict)]
        if not choices:
            return b""
        choice = choices[0]
        before = len(self.progress.text)
        _read_choice(self.progress, choice)  # a finish or a tool call ends what a further resume could continue
        text = "".join(self.progress.text[before:])
        reason = choice.get("finish_reason")
        delta = choice.get("delta")
        calls = delta.get("tool_calls") if isinstance(delta, dict) else None
        if not text and reason is None and not calls:
            return b""  # the continuation's role chunk, or a chunk of ids alone
        out = self._client_chunk(text, reason)
        if calls:  # a text continuation of chat: the sibling's chat endpoint parsed a tool call
            out["choices"][0]["delta"]["tool_calls"] = calls
        return b"data: " + json_body.encode(out) + b"\n\n"

    def _client_chunk(self, text: str, reason: Any) -> dict[str, Any]:
        if self.progress.api == "completions":
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None,
                      "finish_reason": reason}
        return self.progress.chunk([choice])

    def client_usage(self) -> Usage:
        """The usage the client sees: its prompt once, and every part's generated tokens."""
        own = self.usage.completion_tokens if self.usage is not None else 0
        prompt = self.progress.prompt_tokens or len(self.progress.prompt_ids or ())
        return Usage(prompt, self.before + own)

    def _usage_chunk(self) -> bytes:
        return self.progress.usage_event(self.client_usage())

    # The Responses API: the continuation's opening events are dropped, its text deltas moved onto the item
    # the client has, and its closing events written over the whole text.
    _OPENING = frozenset({b"response.created", b"response.in_progress", b"response.output_item.added",
                          b"response.content_part.added"})

    def _responses_event(self, event: bytes) -> bytes:
        kind = events.event_type(event)
        if kind in self._OPENING:
            return b""
        data = events.data_of(event)
        p = self.progress
        item = {"item_id": p.item.get("id"), "output_index": p.item.get("output_index", 0)}
        whole = "".join(p.text)
        if kind == b"response.output_text.delta":
            p.text.append(_text(data, "delta"))
            return self._named(kind, {**data, **item, "content_index": p.item.get("content_index", 0)})
        if kind == b"response.output_text.done":
            return self._named(kind, {**data, **item, "content_index": p.item.get("content_index", 0),
                                      "text": whole})
        if kind == b"response.content_part.done":
            return self._named(kind, {**data, **item, "part": _text_part(data.get("part"), whole)})
        if kind == b"response.output_item.done":
            return self._named(kind, {**data, "output_index": item["output_index"],
                                      "item": self._message(data.get("item"), whole)})
        response = data.get("response")
        if isinstance(response, dict) and kind.startswith(b"response."):
            self.done = kind in (b"response.completed", b"response.incomplete", b"response.failed")
            self.usage = responses.usage_of(response) if self.done else self.usage
            rewritten = self._response(response, whole)
            if self.done:
                self.final = rewritten
                self.progress.finish()
            return self._named(kind, {**data, "response": rewritten})
        return self._named(kind, data) if kind else b""

    def _named(self, kind: bytes, data: dict[str, Any]) -> bytes:
        self.progress.sequence += 1
        return events.sse(kind.decode(), {**data, "sequence_number": self.progress.sequence})

    def _message(self, item: Any, whole: str) -> dict[str, Any]:
        found = dict(item) if isinstance(item, dict) else {"type": "message", "role": "assistant"}
        found["id"] = self.progress.item.get("id")
        found["content"] = [_text_part((found.get("content") or [None])[0], whole)]
        return found

    def _response(self, response: dict[str, Any], whole: str) -> dict[str, Any]:
        out = {**response, "id": self.progress.answer_id, "model": self.progress.model or response.get("model")}
        output = [i for i in response.get("output") or () if isinstance(i, dict)]
        messages = [i for i in output if i.get("type") == "message"]
        if messages:
            out["output"] = [self._message(messages[0], whole)]
        if self.usage is not None and self.done:
            usage = self.client_usage()
            given = response.get("usage")
            out["usage"] = {**(given if isinstance(given, dict) else {}), "input_tokens": usage.prompt_tokens,
                            "output_tokens": usage.completion_tokens,
                            "total_tokens": usage.prompt_tokens + usage.completion_tokens}
        return out


def _text_part(part: Any, whole: str) -> dict[str, Any]:
    found = dict(part) if isinstance(part, dict) else {"type": "output_text", "annotations": []}
    found["text"] = whole
    return found


def _text(data: Mapping[str, Any], key: str) -> str:
    found = data.get(key)
    return found if isinstance(found, str) else ""


def _number(data: Mapping[str, Any], key: str) -> int:
    found = data.get(key)
    return found if isinstance(found, int) and not isinstance(found, bool) else 0


def end_of_finished(progress: Progress, client_wants_usage: bool) -> bytes:
    """What the client is still owed when the deployment broke off after the answer's own end: for chat and
    completions the usage chunk it asked for and [DONE]; a Responses stream's terminal event was the end."""
    if progress.api == "responses":
        return b""
    prompt = progress.prompt_tokens or len(progress.prompt_ids or ())
    usage = progress.usage_event(Usage(prompt, progress.generated_tokens)) if client_wants_usage else b""
    return usage + chat_wire.DONE_EVENT
