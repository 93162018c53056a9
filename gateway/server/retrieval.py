"""The policy's `retrieve` on the request path: the pieces of a conversation that masking and summaries took out,
indexed once they are in the object store, and the most relevant to a step put back at its prompt's end
(context/retrieval.py scores and places them).

    library.index(owner, ref, pieces)                  a masked original (one piece) or a summarized span (one
                                                       per entry), indexed in the background
    body, found = await library.put_back(shape, rule, body, view, owner, refs)   before the decision

The index keeps each piece's terms (its most frequent, bounded) and its embedding (wordllama's static embeddings:
the weights ship in its wheel, loaded once in a thread; until they are, BM25 alone scores); the texts stay in the
object store and are read back only for the pieces chosen. A piece not indexed in this process (another replica
masked it, or it was forgotten) is indexed from the object store for the next step. Per process and bounded:
where many replicas serve a tenant, a shared engine would index once (see docs/context.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from gateway.context.counting import text_tokens
from gateway.context.retrieval import (
    BlockShape,
    Candidate,
    Chosen,
    RetrieveRule,
    block,
    choose,
    piece_terms,
    pieces_of_span,
    query_terms,
    query_text,
)
from gateway.store.contract import StoreError, StoreFault
from gateway.store.objects import ObjectStore
from gateway.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

PIECES_MAX = 1_024  # pieces indexed in this process (at most ~30 KB each); the least recently used go first
INDEXING_MAX = 64  # pieces waiting to be indexed; more are dropped (indexed from the store at a later step)
EMBED_CHARS = 8_000  # a piece's head embedded (static embeddings average their tokens: the rest adds little)


WITHOUT_BLOCK = web.RequestKey("without_block", dict)  # the request's body before its block, for what is stored
AS_SENT = web.RequestKey("as_sent", dict)  # its body before the policy's context rules (a candidate's may differ)


class Embedder(Protocol):
    def embed(self, texts: list[str]) -> Any: ...


@dataclass(frozen=True, slots=True)
class Indexed:
    part: int | None
    terms: Counter[str]
    length: int
    tokens: int
    vector: Any  # a unit numpy vector, or None without embeddings


@dataclass(frozen=True, slots=True)
class PutBack:
    """What retrieval put back in one prompt."""

    chosen: tuple[Chosen, ...]
    candidates: int
    tokens: int

    def describe(self) -> dict[str, Any]:
        return {"candidates": self.candidates, "tokens": self.tokens,
                "pieces": [{"ref": c.candidate.ref, "entry": c.candidate.part, "score": c.score} for c in self.chosen]}


def load_wordllama() -> Embedder | None:
    """wordllama's 256-dimension model from the weights and tokenizer its wheel ships (no download)."""
    try:
        import wordllama
    except ImportError:
        log.warning("retrieval: wordllama is not installed; BM25 alone scores")
        return None
    package = Path(wordllama.__file__).parent  # holds weights/ and tokenizers/, the layout its cache_dir reads
    model: Embedder = wordllama.WordLlama.load(dim=256, cache_dir=package, disable_download=True)
    return model


class Library:
    """The process's index of offloaded pieces, by tenant and reference."""

    def __init__(self, store: ObjectStore, metrics: Metrics,
                 load_embedder: Callable[[], Embedder | None] = load_wordllama) -> None:
        self.store, self.metrics, self._load_embedder = store, metrics, load_embedder
        self._pieces: OrderedDict[tuple[str, str], tuple[Indexed, ...]] = OrderedDict()
        self._pending: set[tuple[str, str]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._embedder: Embedder | None = None
        self._loading: asyncio.Task[None] | None = None

    def index(self, owner: str, ref: str, pieces: Sequence[str], embeddings: bool = True) -> None:
        """Index these pieces of `ref` in the background (a masked output: one; a summarized span: its entries)."""
        key = (owner, ref)
        if key in self._pieces or key in self._pending:
            return
        if len(self._pending) >= INDEXING_MAX:
            self.metrics.context_retrievals.labels("index_dropped").inc()
            return
        self._pending.add(key)
        self._spawn(self._index(key, list(pieces), embeddings))

    def indexed(self, owner: str, ref: str) -> bool:
        return (owner, ref) in self._pieces

    @property
    def size(self) -> int:
        """Originals indexed (a span counts once, whatever its entries)."""
        return len(self._pieces)

    async def put_back(self, shape: BlockShape, rule: RetrieveRule, embeddings: bool, body: dict[str, Any],
                       view: Any, owner: str,
                       refs: Sequence[tuple[str, bool]]) -> tuple[dict[str, Any], PutBack | None]:
        """The body with the most relevant pieces of `refs` (reference, is a span) in one block at its end."""
        if embeddings:
            self._embedding()
        candidates: list[tuple[str, Indexed]] = []
        for ref, span in refs:
            found = self._pieces.get((owner, ref))
            if found is None:
                self._from_store(owner, ref, span, embeddings)
                continue
            self._pieces.move_to_end((owner, ref))
            candidates.extend((ref, piece) for piece in found)
        if not candidates:
            return body, None
        query = query_text(view)
        vector = self._vector(query) if embeddings else None
        scored = [Candidate(ref, p.part, p.terms, p.length, p.tokens, _cosine(vector, p.vector))
                  for ref, p in candidates]
        chosen = choose(scored, query_terms(query), rule, vector is not None)
        texts = await self._texts(owner, chosen)
        if not texts:
            self.metrics.context_retrievals.labels("none").inc()
            return body, PutBack((), len(scored), 0)
        picked = tuple(c for c in chosen if (c.candidate.ref, c.candidate.part) in texts)
        text = block([(c.candidate.ref, c.candidate.part, texts[(c.candidate.ref, c.candidate.part)])
                      for c in picked])
        self.metrics.context_retrievals.labels("put_back").inc()
        self.metrics.context_retrieved_pieces.inc(len(picked))
        return shape.with_block(body, text), PutBack(picked, len(scored), text_tokens(text))

    async def _texts(self, owner: str, chosen: Sequence[Chosen]) -> dict[tuple[str, int | None], str]:
        """The chosen pieces' texts, read back from the object store (a piece it no longer has is left out)."""
        out: dict[tuple[str, int | None], str] = {}
        for ref in dict.fromkeys(c.candidate.ref for c in chosen):
            try:
                data = await self.store.get(owner, ref)
            except (StoreError, StoreFault) as exc:
                log.warning("retrieval: the object store failed reading %s: %s", ref, exc)
                continue
            if data is None:
                continue
            pieces = _pieces_of(data, any(c.candidate.part is not None for c in chosen if c.candidate.ref == ref))
            for c in chosen:
                if c.candidate.ref == ref:
                    index = c.candidate.part or 0
                    if index < len(pieces):
                        out[(ref, c.candidate.part)] = pieces[index]
        return out

    def _from_store(self, owner: str, ref: str, span: bool, embeddings: bool) -> None:
        key = (owner, ref)
        if key in self._pending or len(self._pending) >= INDEXING_MAX:
            return
        self._pending.add(key)
        self._spawn(self._load_and_index(key, span, embeddings))

    async def _load_and_index(self, key: tuple[str, str], span: bool, embeddings: bool) -> None:
        try:
            data = await self.store.get(*key)
        except (StoreError, StoreFault) as exc:
            log.warning("retrieval: %s could not be read to index: %s", key[1], exc)
            data = None
        if data is None:
            self._pending.discard(key)
            return
        await self._index(key, _pieces_of(data, span), embeddings)

    async def _index(self, key: tuple[str, str], pieces: list[str], embeddings: bool) -> None:
        try:
            embedder = self._embedder if embeddings else None
            indexed = await asyncio.to_thread(_indexed, pieces, embedder)
        finally:
            self._pending.discard(key)
        self._pieces[key] = indexed
        self._pieces.move_to_end(key)
        count = sum(len(v) for v in self._pieces.values())
        while count > PIECES_MAX and len(self._pieces) > 1:
            _, dropped = self._pieces.popitem(last=False)
            count -= len(dropped)

    def _embedding(self) -> None:
        """Load the embedder once, in a thread (~0.6 s); BM25 alone scores until it is there."""
        if self._embedder is None and self._loading is None:
            self._loading = self._spawn(self._load())

    async def _load(self) -> None:
        try:
            self._embedder = await asyncio.to_thread(self._load_embedder)
        except (OSError, ValueError, RuntimeError) as exc:  # a broken install: lexical scoring goes on
            log.warning("retrieval: the embeddings did not load (%s); BM25 alone scores", exc)

    def _vector(self, text: str) -> Any:
        if self._embedder is None or not text:
            return None
        return _unit(self._embedder.embed([text])[0])

    def _spawn(self, work: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.create_task(work, name="retrieval index")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks, return_exceptions=True)


def _pieces_of(data: bytes, span: bool) -> list[str]:
    """An original's pieces: its text whole, or a summarized span's entries one by one."""
    return pieces_of_span(data) if span else [data.decode("utf-8", "replace")]


def _indexed(pieces: list[str], embedder: Embedder | None) -> tuple[Indexed, ...]:
    """Each piece's bounded terms, size and embedding (run in a thread: a span can be 100 KB)."""
    vectors = embedder.embed([p[:EMBED_CHARS] for p in pieces]) if embedder is not None and pieces else None
    out = []
    for i, piece in enumerate(pieces):
        kept, length = piece_terms(piece)
        vector = _unit(vectors[i]) if vectors is not None else None
        out.append(Indexed(i if len(pieces) > 1 else None, kept, length, text_tokens(piece), vector))
    return tuple(out)


# The embedder's vectors are numpy arrays; their own operators serve, so a gateway without retrieval never imports
# numpy (a test keeps the embedded-store gateway's imports lean).
def _unit(vector: Any) -> Any:
    norm = float(vector @ vector) ** 0.5
    return vector / norm if norm > 0 else vector


def _cosine(a: Any, b: Any) -> float:
    return 0.0 if a is None or b is None else max(float(a @ b), 0.0)
