"""Retrieval back into the prompt: of what the policy's context rules took out of a conversation (masked tool
outputs, summarized entries), the pieces most relevant to the step are put back as one delimited block at the
prompt's end, within a token budget (pure: scoring, choosing, the block and where each API takes it).

    query = query_terms(query_text(view))          the newest messages' words, identifiers weighted up
    chosen = choose(candidates, query, rule, embedded)   ranked by BM25 over the step's candidates only, kept
                                                   over min_score (identifier coverage and the embedding's cosine)
    body = shape.with_block(body, block(chosen))    the block after everything else: the prefix is untouched

A candidate is one piece the step's prompt no longer holds whole: a masked output (its stub is in the prompt) or
one entry of a summarized span (the summary is). The block goes last, after the newest message, so every token
before it is the prompt the deployment would read without it and stays in its prefix cache.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.context.masking import read_stub
from gateway.features import text_of

RETRIEVE = "retrieve"  # the name of the rule in the policy, the trail and the metrics
BLOCK_OPEN = "<retrieved_context source=\"agent-gateway\">"
BLOCK_CLOSE = "</retrieved_context>"
BLOCK_LEAD = ("Earlier tool outputs and turns of this conversation that the gateway kept out of the prompt and "
              "found relevant to this step, whole:")
QUERY_MESSAGES = 3  # the newest messages the query reads
QUERY_CHARS = 4_000  # of them, at most (their ends: an error is usually last)
_TERM = re.compile(r"[a-z_][a-z0-9_]{2,}|[0-9]{3,}")
_QUERY_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]{2,}|[0-9]{3,}")
TERMS_MAX = 512  # a piece's most frequent terms the index keeps (a bound on its memory: ~30 KB a piece)
IDENTIFIER_WEIGHT = 3  # python -m evals.retrieval: top-1 right 59 of 62 with it, 39 of 50 without
K1, B = 1.2, 0.75  # BM25's usual constants


@dataclass(frozen=True, slots=True)
class RetrieveRule:
    """What comes back: at most `max_documents` pieces, `budget_tokens` in all, each scoring `min_score` or more
    (its coverage of the query's identifiers, averaged with its embedding's cosine to the query)."""

    budget_tokens: int = 2_000
    max_documents: int = 3
    min_score: float = 0.45


@dataclass(frozen=True, slots=True)
class Candidate:
    """One piece the prompt no longer holds whole, with what scoring reads of it."""

    ref: str  # the object store's reference of the original (a masked output, or a summarized span)
    part: int | None  # the entry's index in the span; None: the whole original
    terms: Counter[str]
    length: int  # its terms in all
    tokens: int  # its tokens, for the budget
    cosine: float  # its embedding's cosine to the query's (0.0 when there are no embeddings)


@dataclass(frozen=True, slots=True)
class Chosen:
    candidate: Candidate
    score: float


# English words too common to say what a step is about (the query is an agent's words and its commands').
STOPWORDS = frozenset((
    "the", "and", "for", "with", "this", "that", "from", "are", "was", "were", "not", "you", "your", "has",
    "have", "had", "but", "all", "can", "its", "into", "out", "use", "then", "than", "there", "their", "them",
    "they", "will", "would", "should", "could", "what", "when", "where", "which", "who", "why", "how", "our",
    "now", "get", "got", "let", "may", "might", "must", "also", "just", "any", "each", "more", "most", "some",
    "such", "only", "own", "same", "too", "very", "off", "over", "under", "again", "once", "here", "both",
    "few", "other", "nor", "yes", "been", "being", "does", "did", "doing", "done",
))


def terms(text: str) -> Counter[str]:
    """The words scoring reads: identifiers, words of three letters or more and long numbers, lowercased, but
    the commonest English words."""
    return Counter(t for t in _TERM.findall(text.lower()) if t not in STOPWORDS)


_NOT_WORDS = frozenset({"type", "role", "id", "call_id", "tool_call_id", "tool_use_id", "cache_control", "status"})


def entry_text(entry: Any) -> str:
    """What one entry of a summarized span says: every string in it but its ids and kinds, in order."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, Mapping):
        return "\n".join(filter(None, (entry_text(v) for k, v in entry.items() if k not in _NOT_WORDS)))
    if isinstance(entry, list):
        return "\n".join(filter(None, map(entry_text, entry)))
    return ""


def pieces_of_span(document: bytes) -> list[str]:
    """A summarized span's entries (the object store's JSON array) as retrieval's pieces, one each."""
    text = document.decode("utf-8", "replace")
    try:
        entries = json.loads(text)
    except ValueError:
        return [text]
    return [entry_text(entry) for entry in entries] if isinstance(entries, list) else [text]


def query_text(view: Mapping[str, Any]) -> str:
    """What the step is about: the newest messages' text and tool calls (a command, an error), their ends kept;
    not the stubs among them (their head and tail would find their own originals)."""
    messages = view.get("messages")
    parts: list[str] = []
    for message in (messages if isinstance(messages, list) else [])[-QUERY_MESSAGES:]:
        if not isinstance(message, Mapping):
            continue
        text = text_of(message.get("content"))
        if read_stub(text) is None and not text.startswith(BLOCK_OPEN):  # a stub or a block is what comes back
            parts.append(text)
        for call in message.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, Mapping) else None
            if isinstance(function, Mapping):
                parts.append(f"{function.get('name')} {function.get('arguments') or ''}")
    text = "\n".join(part for part in parts if part)
    return text[-QUERY_CHARS:]


def bm25(query: Counter[str], candidates: Sequence[Candidate]) -> list[float]:
    """Each candidate's BM25 score for the query, the collection being the candidates themselves."""
    if not candidates or not query:
        return [0.0] * len(candidates)
    n = len(candidates)
    average = sum(c.length for c in candidates) / n or 1.0
    holding = Counter(term for c in candidates for term in c.terms.keys() & query.keys())
    idf = {term: math.log(1 + (n - held + 0.5) / (held + 0.5)) for term, held in holding.items()}
    scores = []
    for c in candidates:
        norm = K1 * (1 - B + B * c.length / average)
        scores.append(sum(query[t] * idf[t] * c.terms[t] * (K1 + 1) / (c.terms[t] + norm)
                          for t in query.keys() & c.terms.keys()))
    return scores


def piece_terms(text: str) -> tuple[Counter[str], int]:
    """A piece's terms as the index keeps them (its TERMS_MAX most frequent: a bound on the index's memory) and
    how many terms it has in all (BM25's length)."""
    counted = terms(text)
    # interned: the same identifiers recur across a session's pieces, and each piece holds its own copies otherwise
    return Counter({sys.intern(t): n for t, n in counted.most_common(TERMS_MAX)}), sum(counted.values())


def query_terms(text: str) -> Counter[str]:
    """The query's words, weighted: an identifier (snake_case, camelCase, digits in it, or 10 letters or more: a
    function, an error's class, a file) counts IDENTIFIER_WEIGHT times a plain word."""
    weighted: Counter[str] = Counter()
    for token in _QUERY_TOKEN.findall(text):
        low = token.lower()
        if low in STOPWORDS:
            continue
        identifier = "_" in token or any(ch.isdigit() for ch in token) or not token[1:].islower() or len(token) >= 10
        weighted[low] += IDENTIFIER_WEIGHT if identifier else 1
    return weighted


def coverage(query: Counter[str], piece: Candidate) -> float:
    """The share of the query's identifiers' weight the piece holds (of all its words' when it names none)."""
    named = {t: w for t, w in query.items() if w >= IDENTIFIER_WEIGHT} or dict(query)
    total = sum(named.values())
    return sum(w for t, w in named.items() if t in piece.terms) / total if total else 0.0


def choose(candidates: Sequence[Candidate], query: Counter[str], rule: RetrieveRule,
           embedded: bool) -> list[Chosen]:
    """The pieces to put back, best first by BM25 (`query` as `query_terms` weights it); a piece comes back only
    with some lexical match and an absolute score of `min_score` or more: its coverage of the query's
    identifiers, averaged with its embedding's cosine when there are embeddings; within the budget and count."""
    lexical = bm25(query, candidates)
    ranked = sorted((i for i, score in enumerate(lexical) if score > 0.0), key=lambda i: -lexical[i])
    chosen: list[Chosen] = []
    spent = 0
    for i in ranked:
        piece = candidates[i]
        score = (coverage(query, piece) + piece.cosine) / 2 if embedded else coverage(query, piece)
        if score < rule.min_score or len(chosen) >= rule.max_documents:
            continue
        if spent + piece.tokens <= rule.budget_tokens:
            chosen.append(Chosen(piece, round(score, 4)))
            spent += piece.tokens
    return chosen


def block(pieces: Sequence[tuple[str, int | None, str]]) -> str:
    """The one delimited block the pieces go back in: (reference, entry or None, text) each under its name."""
    out = [BLOCK_OPEN, BLOCK_LEAD]
    for ref, part, text in pieces:
        named = ref if part is None else f"{ref} entry {part}"
        out.append(f"--- {named} ---\n{text}")
    out.append(BLOCK_CLOSE)
    return "\n".join(out)


class BlockShape(Protocol):
    """Where one API's body takes the block: after everything the client sent."""

    def with_block(self, body: Mapping[str, Any], text: str) -> dict[str, Any]: ...


class ChatBlock:
    def with_block(self, body: Mapping[str, Any], text: str) -> dict[str, Any]:
        return {**body, "messages": [*body["messages"], {"role": "user", "content": text}]}


class ResponsesBlock:
    def with_block(self, body: Mapping[str, Any], text: str) -> dict[str, Any]:
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
        return {**body, "input": [*body["input"], item]}


class MessagesBlock:
    """Messages: a text block after the last user turn's tool results (a user turn may not follow a user turn)."""

    def with_block(self, body: Mapping[str, Any], text: str) -> dict[str, Any]:
        messages = list(body["messages"])
        last = messages[-1] if messages else None
        added = {"type": "text", "text": text}
        if isinstance(last, Mapping) and last.get("role") == "user":
            content = last.get("content")
            blocks = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
            messages[-1] = {**last, "content": [*blocks, added]}
        else:
            messages.append({"role": "user", "content": [added]})
        return {**body, "messages": messages}


CHAT = ChatBlock()
RESPONSES = ResponsesBlock()
MESSAGES = MessagesBlock()
