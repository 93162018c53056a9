"""What the pipeline asks of an API: read a native request into the common view, write answers back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from gateway.apis.chat.wire import StreamTally
from gateway.apis.json_body import Source
from gateway.apis.recurring import Recurring
from gateway.apis.usage import Usage
from gateway.context.anthropic_edits import Managed
from gateway.context.eviction import TurnShape
from gateway.context.retrieval import BlockShape
from gateway.context.tool_outputs import ToolOutputs
from gateway.errors import GatewayError
from gateway.features import Features, extract


class StreamReader(Protocol):
    """Reads one deployment's stream as it is relayed: passes events on, notes usage and a proper end."""

    usage: Usage | None  # the deployment's own count, from the stream's final usage
    done: bool  # the stream ended as this API ends one ([DONE], a terminal event)
    error: bool  # the deployment ended it with its own error event, which the reader withheld
    streamed: StreamTally  # what was generated, should the usage never come

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to send the client for this chunk of the deployment's stream."""
        ...

    def error_event(self, err: GatewayError) -> bytes:
        """The end of a stream that failed after its first byte, as this API ends one."""
        ...

    def answer_view(self) -> dict[str, Any] | None:
        """What was streamed as a chat completion, for the agent step (None: the step reads the chat chunks)."""
        ...


class Adapter(Protocol):
    """One API: its path on the gateway and on every deployment, and its request and answer formats.

    Decision, admission, accounting, experiments and telemetry see only what `read` returns (features and a
    chat-shaped view of the conversation), never the native body.
    """

    endpoint: str  # the gateway's name for the API: metric labels, spans, the request log, `policy explain`
    path: str  # the deployment's own path for it (vLLM serves every API the gateway does)
    operation: str  # the GenAI semantic conventions' operation name
    chains: bool  # its requests may continue a stored response (`previous_response_id`)
    generates: bool  # it generates tokens (count_tokens does not: no agent step, nothing to charge)
    resumable: bool  # a broken stream of it can be finished by another deployment (gateway/server/resuming.py)
    step_from_chunks: bool  # the agent step reads the tool calls from the relayed chat chunks themselves
    turns: TurnShape | None  # its conversation's entries, for the policy's summaries of old turns (None: none)
    block: BlockShape | None  # where retrieval's block goes in its bodies (None: never)
    assistant_texts: ToolOutputs | None  # its assistant turns' texts, masked only to fit a window (None: never)
    tool_outputs: ToolOutputs | None  # where its bodies hold tool outputs, for the policy's masking (None: none)

    def parse(self, raw: bytes, recurring: Recurring | None = None) -> Source:
        """The request body, checked leniently (a 400 names a field the gateway reads that has a wrong type), with
        its bytes; its conversation read through `recurring` when given (json_body.read)."""
        ...

    def manage_context(self, body: dict[str, Any]) -> tuple[dict[str, Any], Managed | None]:
        """The body after the context edits the API asks the gateway to make (None: it asked for none)."""
        ...

    def view(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        """The body as the decision reads it: chat-shaped (`messages`, `tools`, …) or completions-shaped."""
        ...

    def features(self, view: Mapping[str, Any], sent: Source | None = None) -> Features:
        """The view's features; `sent`: the request's bytes, for what the view holds of them as sent."""
        ...

    def upstream_body(self, body: dict[str, Any], served_model: str, cap_tokens: int | None,
                      source: Source | None = None) -> tuple[bytes, bool]:
        """The body for a deployment and whether the client asked for the stream's usage itself; `source`: the
        request's bytes and their parse, when nothing edited it (`body` is that parse or a copy with members added)."""
        ...

    def usage_of(self, answer: Mapping[str, Any]) -> Usage | None: ...

    def answer(self, raw: bytes, found: dict[str, Any], answer_id: str,
               managed: Managed | None = None) -> tuple[bytes, dict[str, Any]]:
        """A non-streamed answer as the client gets it (a Responses answer renamed to the gateway's id, a Messages
        answer with the context edits made to its prompt)."""
        ...

    def answer_view(self, found: Mapping[str, Any]) -> dict[str, Any] | None:
        """A non-streamed answer as a chat completion, for the agent step (None: the answer is one already)."""
        ...

    def stream_reader(self, client_wants_usage: bool, answer_id: str, managed: Managed | None = None) -> StreamReader:
        ...

    def new_id(self) -> str:
        """The id the gateway gives this call's answer ("" when the deployment's own is kept)."""
        ...

    def envelope(self, err: GatewayError) -> dict[str, Any]:
        """An error as this API's clients expect its body."""
        ...

    def error_answer(self, status: int, raw: bytes, found: dict[str, Any]) -> bytes:
        """A deployment's error answer (a 4xx) as this API's clients expect its body."""
        ...


def features_as_chat(view: Mapping[str, Any], api: str) -> Features:
    """The features of an agent API's request, read from its chat-shaped view; the endpoint stays the API's own,
    for the decision must know which API the deployment serves."""
    features = extract(view, "chat")
    features.endpoint = api
    return features
