"""The one summarizing call every summary the gateway writes goes through (compaction, summaries of old turns):
the prompt to a deployment's chat completions endpoint, its answer read back in the anchored structure
(context/summaries.py).

    written = await write(pool, limit_bytes, policy, name, prompt, request_id, max_tokens, tokens_before)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.apis import json_body
from gateway.apis.chat import wire as chat_wire
from gateway.apis.usage import Usage
from gateway.context.summaries import written_summary
from gateway.errors import UpstreamError
from gateway.policy.model import Policy
from gateway.upstream import forward as upstream
from gateway.upstream.client import Pool

CHAT_PATH = chat_wire.PATHS["chat"]


@dataclass(frozen=True, slots=True)
class Written:
    """A summary as a deployment wrote it, and what it replaced."""

    text: str  # in the anchored structure (gateway/context/summaries.py), or the client's own instructions' form
    deployment: str
    model: str | None
    usage: Usage
    tokens_before: int  # the conversation it summarized, in the gateway's count



async def write(pool: Pool, limit_bytes: int, policy: Policy, name: str, prompt: Sequence[Mapping[str, Any]],
                request_id: str, max_tokens: int, tokens_before: int, instructions: str | None = None) -> Written:
    """The one summarizing call: `prompt` (chat messages that end in the ask) to deployment `name`, its answer
    read back in the anchored structure (or the client's own instructions' form)."""
    dep = policy.deployments[name]
    body = {"model": dep.served_model, "messages": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": False}
    fetched = await upstream.fetch(pool, name, dep, CHAT_PATH, json_body.encode(body),
                                   {"x-request-id": request_id}, timeout_s=policy.compaction.timeout_s,
                                   limit_bytes=limit_bytes)
    found = json_body.response_object(fetched.body) if fetched.status == 200 else None
    choices = found.get("choices") if found is not None else None
    message = choices[0].get("message") if isinstance(choices, list) and choices and \
        isinstance(choices[0], dict) else None
    text = message.get("content") if isinstance(message, dict) else None
    if not isinstance(text, str) or not text.strip():
        raise UpstreamError(f"Deployment {name!r} wrote no summary (status {fetched.status})",
                            code="compaction_failed")
    assert found is not None
    model = found.get("model")
    used = chat_wire.usage_of(found) or Usage(tokens_before, 0, estimated=True)
    return Written(written_summary(text, instructions), name, model if isinstance(model, str) else None, used,
                   tokens_before)
