"""A prompt counted in a deployment's own tokens (vLLM's /tokenize) when it comes near its window, memoized by prefix.

An agent's step re-sends its whole conversation plus the newest messages. The prompt's parts (the tool schemas
first, then each message's text) are chained by hash, and the memo keeps the count of a chain's text up to its
last part; a step finds its longest counted prefix there and sends /tokenize only the parts after it. A count
that fails (the deployment's /tokenize is slow, down or missing) falls back to a bound from an exact cl100k
count, with a warning and a metric: it never waits longer than TOKENIZE_TIMEOUT_S.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from gateway.apis import json_body
from gateway.decision import windows
from gateway.decision.call import Call
from gateway.errors import GatewayError, UpstreamError
from gateway.features import prompt_floor, text_of
from gateway.policy.model import Deployment
from gateway.upstream import forward as upstream
from gateway.upstream.client import Pool

log = logging.getLogger(__name__)

TOKENIZE_PATH = "/tokenize"
TOKENIZE_TIMEOUT_S = 2.0  # vLLM tokenizes ~80k tokens in well under a second; past this the bound serves
MEMO_ENTRIES = 8192  # chain ends remembered, all deployments together (~150 bytes each)
FALLBACK_MAX_CHARS = 1_000_000  # the fallback's exact cl100k count reads at most this much (~0.1 s, in a thread)

Part = str | int  # a text to count, or a number of tokens already known (a prompt given as token ids)
# Told (deployment, outcome) of every count: "counted" (its /tokenize, for the new part), "memo" (no new part),
# "failed" (a bound was used); the app makes it a metric.
Counted = Callable[[str, str], None]


def parts(view: Mapping[str, Any], endpoint: str, start: int = 0) -> Iterator[Part]:
    """What the model reads, in the order its prompt has it: the tool schemas as a chat template lists them (one
    JSON object a line), then each message's text (an assistant's tool calls with it); a completion's prompts.
    From the part numbered `start` on (the ones before are not built)."""
    tools = view.get("tools")
    if isinstance(tools, list) and tools:
        if start == 0:
            yield "\n".join(json.dumps(tool, ensure_ascii=False, default=str) for tool in tools)
        start = max(start - 1, 0)
    if endpoint == "completions":
        prompt = view.get("prompt")
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        for item in prompt[start:] if isinstance(prompt, list) else ():
            yield item if isinstance(item, str) else len(item) if isinstance(item, list) else 0
        return
    messages = view.get("messages")
    for message in [m for m in messages if isinstance(m, Mapping)][start:] if isinstance(messages, list) else ():
        yield _message_text(message)


def links_of(call: Call, endpoint: str) -> tuple[list[bytes] | list[str], list[Part] | None]:
    """The prompt's links, one a part: a chat's are the call's own prompt chain (context/prefix.py, hashed once a
    call for the session caches too), whose links fall where the parts do, one for the tools and one a message;
    else (a completion's prompts, a chain cut at its MAX_LINKS) a chain of the parts, returned with them."""
    if endpoint == "chat":
        tools = call.view.get("tools")
        # the features counted the view's messages (those that are objects) as the chain links them
        count = (1 if isinstance(tools, list) and tools else 0) + call.features.message_count
        shared = call.prompt
        if len(shared) == count:  # else tools of another type, or more messages than MAX_LINKS
            return shared.digests, None
    prompt = list(parts(call.view, endpoint))
    return chain(prompt), prompt


def _message_text(message: Mapping[str, Any]) -> str:
    text = text_of(message.get("content"))
    calls = message.get("tool_calls")
    if isinstance(calls, list) and calls:
        text += "\n" + json_body.encode(calls).decode()
    return text


def chain(prompt: list[Part]) -> list[bytes]:
    """Each part's link: the hash of the link before it and the part, so equal links mean equal prefixes."""
    links: list[bytes] = []
    link = b""
    for part in prompt:
        data = part.encode("utf-8", "surrogatepass") if isinstance(part, str) else b"\0%d" % part
        link = hashlib.blake2b(link + hashlib.blake2b(data, digest_size=16).digest(), digest_size=16).digest()
        links.append(link)
    return links


class Memo:
    """Texts' token counts by (deployment, chain link), least recently used first out. A link is a chain_of digest
    (hex) or a `chain` one (bytes): the two never compare equal."""

    def __init__(self, size: int = MEMO_ENTRIES) -> None:
        self._size = size
        self._counts: OrderedDict[tuple[str, bytes | str], int] = OrderedDict()

    def longest(self, name: str, links: Sequence[bytes | str]) -> tuple[int, int]:
        """(how many parts, their tokens) of the longest prefix counted before; (0, 0) when none was."""
        for i in range(len(links) - 1, -1, -1):
            key = (name, links[i])
            tokens = self._counts.get(key)
            if tokens is not None:
                self._counts.move_to_end(key)
                return i + 1, tokens
        return 0, 0

    def keep(self, name: str, link: bytes | str, tokens: int) -> None:
        self._counts[(name, link)] = tokens
        self._counts.move_to_end((name, link))
        while len(self._counts) > self._size:
            self._counts.popitem(last=False)

    def __len__(self) -> int:
        return len(self._counts)


class DeploymentCounts:
    """Counts a call's prompt with the tokenizer of each deployment whose window it comes near."""

    def __init__(self, pool: Pool, counted: Counted, timeout_s: float = TOKENIZE_TIMEOUT_S) -> None:
        self._pool, self._counted, self._timeout_s = pool, counted, timeout_s
        self.memo = Memo()

    async def count(self, call: Call, learned: Mapping[str, int]) -> dict[str, windows.Count]:
        """The prompt in the tokens of each deployment near whose window it is (none for most calls: one
        comparison a deployment)."""
        features, policy = call.features, call.policy
        near = [name for name, dep in policy.deployments.items() if features.endpoint in dep.endpoints
                and windows.near_edge(windows.window_of(dep.max_model_len, learned.get(name)), features)]
        if not near:
            return {}
        endpoint = "completions" if features.endpoint == "completions" else "chat"
        links, prompt = links_of(call, endpoint)
        found = await asyncio.gather(*(self._count(name, policy.deployments[name], endpoint, prompt, links, call)
                                       for name in near))
        return dict(zip(near, found, strict=True))

    async def _count(
        self, name: str, dep: Deployment, endpoint: str, prompt: list[Part] | None, links: Sequence[bytes | str],
        call: Call,
    ) -> windows.Count:
        start, tokens = self.memo.longest(name, links)
        if start == len(links):
            self._counted(name, "memo")
            return windows.Count(tokens + windows.template_tokens(call.features), True)
        rest = prompt[start:] if prompt is not None else list(parts(call.view, endpoint, start))
        tokens += sum(part for part in rest if isinstance(part, int))
        text = "\n".join(part for part in rest if isinstance(part, str))
        try:
            tokens += await self._tokenize(dep, text) if text else 0
        except GatewayError as exc:
            log.warning("deployment %s could not count a prompt (%s); judging its window by a bound instead",
                        name, exc.message)
            self._counted(name, "failed")
            return await fallback(call)
        self._counted(name, "counted")
        if links:
            self.memo.keep(name, links[-1], tokens)
        return windows.Count(tokens + windows.template_tokens(call.features), True)

    async def _tokenize(self, dep: Deployment, text: str) -> int:
        body = json_body.encode({"model": dep.served_model, "prompt": text, "add_special_tokens": False})
        status, raw = await upstream.post(self._pool, dep.url + TOKENIZE_PATH, body, self._timeout_s)
        found = json_body.response_object(raw)
        count = found.get("count") if found is not None else None
        if status != 200 or not isinstance(count, int):
            raise UpstreamError(f"/tokenize answered {status} without a count")
        return count


async def fallback(call: Call) -> windows.Count:
    """A bound on the prompt in any deployment's tokens when its own count failed: an exact cl100k count (in a
    worker thread, bounded) times TOKENS_PER_CL100K_MAX, else the bytes bound."""
    features = call.features
    endpoint = "completions" if features.endpoint == "completions" else "chat"
    counted, whole = await asyncio.to_thread(prompt_floor, call.view, endpoint, FALLBACK_MAX_CHARS, 1 << 62)
    if not whole:
        return windows.Count(windows.prompt_bound(features), False)
    tokens = math.ceil(counted * windows.TOKENS_PER_CL100K_MAX) + windows.template_tokens(features)
    return windows.Count(min(tokens, windows.prompt_bound(features)), False)
