"""The policy's context rules (masking old tool outputs, per route and tenant) and where masked originals go.

    context:                      # the policy's own; a route (`models.NAME.context`) or a tenant
      mask_tool_outputs:          # (`tenants[i].context`) may give its own, the tenant's first
        keep_last: 3
        over_tokens: 200
        batch_tokens: 8000
      summarize_old_turns:        # the oldest turns given way to one summary, in large steps
        over_tokens: 16000
        keep_tokens: 4000
      retrieve:                   # what those two took out, the relevant pieces put back at the end
        budget_tokens: 2000
    store:
      objects: {path: ..., max_bytes: ..., ttl_s: ..., s3: {bucket: ...}}

Off unless given. `context: {}` on a route or a tenant turns both off there.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from gateway.context.eviction import EvictRule
from gateway.context.masking import MaskRule
from gateway.context.retrieval import RetrieveRule
from gateway.frozen import Frozen


class MaskToolOutputs(Frozen):
    """Tool outputs older than the newest `keep_last` (and over `over_tokens`) give way to a stub that names the
    original, kept in the object store; the masked part grows only by `batch_tokens` or more at once."""

    keep_last: int = Field(3, ge=0, le=10_000, description="the newest tool outputs, never masked")
    over_tokens: int = Field(200, ge=0, description="only outputs over this many tokens are masked")
    batch_tokens: int = Field(8_000, ge=0, description="the masked part grows only when this many tokens can be "
                                                      "saved at once (so the prompt's prefix stays cached)")
    head_chars: int = Field(600, ge=0, le=100_000, description="the output's first characters the stub shows")
    tail_chars: int = Field(600, ge=0, le=100_000, description="the output's last characters the stub shows")

    def rule(self) -> MaskRule:
        return MaskRule(self.keep_last, self.over_tokens, self.batch_tokens, self.head_chars, self.tail_chars)


class SummarizeOldTurns(Frozen):
    """Once what follows a conversation's head (its system prompt and task) is over `over_tokens`, all but its
    newest `keep_tokens` (whole turns) give way to one anchored summary, written off the hot path by the
    policy's compaction deployment after a step and put in at the next; the summarized entries go to the object
    store. The summary changes only when the span moves again, so the prompt's prefix stays cached between."""

    over_tokens: int = Field(16_000, ge=1_000, description="what follows the head may grow to this many tokens")
    keep_tokens: int = Field(4_000, ge=0, description="the newest entries kept whole, at most this many tokens "
                                                      "(at least the newest turn)")
    summary_tokens: int = Field(1_024, ge=64, le=16_384, description="the summary's bound (its max_tokens)")

    @model_validator(mode="after")
    def _room(self) -> SummarizeOldTurns:
        if self.over_tokens <= self.keep_tokens + self.summary_tokens:
            raise ValueError(f"over_tokens ({self.over_tokens}) must be more than keep_tokens + summary_tokens "
                             f"({self.keep_tokens} + {self.summary_tokens}), or every step would summarize again")
        return self

    def rule(self) -> EvictRule:
        return EvictRule(self.over_tokens, self.keep_tokens, self.summary_tokens)


class Retrieve(Frozen):
    """Of what masking and summaries took out of the conversation, the pieces most relevant to the step (its
    newest messages: the user's words, the tool call, the output) go back whole in one block at the prompt's end."""

    budget_tokens: int = Field(2_000, ge=100, le=100_000, description="the block's pieces, in all")
    max_documents: int = Field(3, ge=1, le=20)
    min_score: float = Field(0.45, ge=0.0, le=1.0, description="a piece's share of the step's identifiers, "
                                                             "averaged with its embedding's cosine to the step's")
    embeddings: bool = Field(True, description="score with wordllama's static embeddings beside BM25 (its weights "
                                               "ship in its wheel: nothing is downloaded)")

    def rule(self) -> RetrieveRule:
        return RetrieveRule(self.budget_tokens, self.max_documents, self.min_score)


class ContextPolicy(Frozen):
    """What the gateway does to a conversation's context before a deployment reads it."""

    mask_tool_outputs: MaskToolOutputs | None = None
    summarize_old_turns: SummarizeOldTurns | None = None
    retrieve: Retrieve | None = None


class S3Objects(Frozen):
    """An S3 bucket (or an S3-compatible server) every replica shares; credentials come from the environment
    (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN), never from the policy. Expire old objects
    with the bucket's lifecycle rule; reads older than `ttl_s` are refused all the same."""

    bucket: str = Field(min_length=3, max_length=63)
    prefix: str = "agent-gateway/context"
    region: str = "us-east-1"
    endpoint: str | None = Field(None, description="an S3-compatible server's URL (MinIO, Ceph); default: AWS")
    timeout_s: float = Field(10.0, gt=0, le=300)


class ObjectStorePolicy(Frozen):
    """Where masked tool outputs are kept: the local disk (the default; content-addressed, per tenant, bounded,
    expiring) or S3 (`s3:`), which replicas share."""

    path: str | None = Field(None, description="the local store's folder; default: AGENT_GATEWAY_OBJECTS_DIR")
    max_bytes: int = Field(1 << 30, ge=1 << 20, description="the local store's bound; the oldest go first")
    tenant_max_bytes: int | None = Field(None, ge=1 << 16, description="each tenant's bound in the local store")
    ttl_s: float = Field(7 * 86_400, gt=0, description="an original is kept this long after it was last masked")
    s3: S3Objects | None = None
