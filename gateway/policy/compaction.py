"""The policy's `compaction` section: which deployment summarizes a conversation when a client compacts it.

    compaction:
      deployment: fast          # default: `fast` when the policy declares it, else the policy's `default`
      max_summary_tokens: 2048  # the summary's cap
      timeout_s: 120            # the whole summarizing call

The deployment is asked through its chat completions endpoint (every vLLM serves it), whatever API the
client compacts through (the Responses API's /compact, its compaction_trigger item, context_management).
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import Field

from gateway.frozen import Frozen

DEFAULT_DEPLOYMENT = "fast"


class CompactionPolicy(Frozen):
    deployment: str | None = None
    max_summary_tokens: int = Field(2048, ge=64, le=32_768)
    timeout_s: float = Field(120.0, gt=0)
    # The transcript's bound in characters when the deployment declares no max_model_len.
    max_transcript_chars: int = Field(400_000, ge=1_000)

    def summarizer(self, deployments: Mapping[str, object], default: str) -> str:
        """The deployment that summarizes: the one named, else `fast` when declared, else the policy's default."""
        if self.deployment is not None:
            return self.deployment
        return DEFAULT_DEPLOYMENT if DEFAULT_DEPLOYMENT in deployments else default
