"""One client call as the decision sees it, read once per request and passed to every stage after."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.agents.session_ids import session_id
from gateway.agents.steps import AgentStep, read_step
from gateway.apis.json_body import Source
from gateway.context.anthropic_edits import Managed
from gateway.context.masking import Masking
from gateway.context.prefix import Chain, chain_of
from gateway.decision.admission import ANONYMOUS
from gateway.features import Features, prompt_tokens_with_template
from gateway.policy.model import Policy


class Call:
    """What the decision reads of one request: the policy in force, the features, where it stands in its agent
    loop, who sends it. Built once (by `read_call`, or from a log line); treated as immutable (slots, not
    frozen: a frozen class sets each field through object.__setattr__, which costs microseconds a request)."""

    __slots__ = ("_prompt", "_session", "body", "body_bytes", "chain", "context", "endpoint", "features", "headers",
                 "masking", "policy", "sent", "step", "tenant", "view")

    def __init__(self, policy: Policy, endpoint: str, body: dict[str, Any], view: Mapping[str, Any],
                 body_bytes: int, features: Features, headers: Mapping[str, str], tenant: str | None,
                 step: AgentStep | None, chain: str | None = None, context: Managed | None = None,
                 masking: Masking | None = None, sent: Source | None = None) -> None:
        self.policy, self.endpoint, self.body, self.view = policy, endpoint, body, view
        self.body_bytes, self.features, self.headers = body_bytes, features, headers
        self.tenant = tenant  # None when auth is off: no tenant rule can match it
        self.step = step
        self.chain = chain  # the session of the stored response this call continues (the Responses API)
        self.context = context  # the API's context edits the gateway made to `body` (Anthropic's context_management)
        self.masking = masking  # the old tool outputs the gateway masked in `body` (the policy's context rules)
        self.sent = sent  # the request's bytes and what they parsed to (None for a call read from a log line)
        self._session: tuple[str | None] | None = None
        self._prompt: Chain | None = None

    @property
    def tenant_or_anonymous(self) -> str:
        """The tenant budgets, trajectories and the request record are kept under."""
        return self.tenant or ANONYMOUS

    @property
    def source(self) -> Source | None:
        """The request's bytes while `body` is still their parse (None once the gateway edited the body)."""
        return self.sent if self.sent is not None and self.sent.body is self.body else None

    @property
    def session_id(self) -> str | None:
        """The agent session this call belongs to (agents/session_ids.py), worked out on first use only."""
        if self._session is None:
            self._session = (session_id(self.headers, self.view, self.chain),)
        return self._session[0]


    @property
    def prompt(self) -> Chain:
        """The prompt's hash chain (context/prefix.py), hashed on first use only: the session caches read what each
        deployment holds of it, and the window counter keys its memo by it."""
        if self._prompt is None:
            sent = self.sent
            tools_sent = sent.member_as_sent("tools", self.view.get("tools")) if sent is not None else None
            self._prompt = chain_of(self.view, prompt_tokens_with_template(self.features), tools_sent,
                                    sent.recurring if sent is not None else None,
                                    sent.conversation if sent is not None else None)
        return self._prompt


def read_call(policy: Policy, endpoint: str, body: dict[str, Any], view: Mapping[str, Any], body_bytes: int,
              features: Features, headers: Mapping[str, str], tenant: str | None, chain: str | None = None,
              context: Managed | None = None, masking: Masking | None = None, sent: Source | None = None) -> Call:
    """The call of a request body: its agent step read from the view when a rule of the policy reads it."""
    step = read_step(view, sent.conversation if sent is not None else None) if policy.reads_steps else None
    return Call(policy, endpoint, body, view, body_bytes, features, headers, tenant, step, chain, context, masking,
                sent)
