"""The coding agents' own compaction requests, recognized by the instruction they end their conversation with.

Codex (its local compaction turn) and Claude Code (its summary request) ask the model, in a last user message, to
summarize the whole conversation: the longest prompt of a session, sent when it is already near the window. The
gateway serves them on the deployment with the largest window (decision/routing.py), so they cannot fail as too
long where another deployment holds them. Recognized by key phrases at the instruction's start rather than its
whole text, which changes between the agents' versions (checked against Codex 0.169.0 and Claude Code 2.1.332).
"""

from __future__ import annotations

from gateway.context.masking import MaskRule

CLAUDE_SUMMARY_TASK = "Your task is to create a detailed summary of the conversation so far"
# The instruction's opening words by the agent that sends it, each with a phrase that must follow within
# FOLLOWS_WITHIN_CHARS (None: the opening says enough). Claude Code 2.1.332 puts a no-tools preamble before its
# summary task; the preamble alone is too general to name a summary request.
OPENINGS: dict[str, tuple[tuple[str, str | None], ...]] = {
    "codex": (("CONTEXT CHECKPOINT COMPACTION", None),),
    "claude-code": (
        (CLAUDE_SUMMARY_TASK, None),
        ("CRITICAL: Respond with TEXT ONLY. Do NOT call any tools.", CLAUDE_SUMMARY_TASK),
    ),
}
LOOKED_AT_CHARS = 400  # the opening starts the instruction; what follows may be long
FOLLOWS_WITHIN_CHARS = 1_500  # the fixed preamble before the task is ~470 characters


def compaction_asker(last_user_text: str) -> str | None:
    """The agent whose compaction instruction the last user message is, else None."""
    text = last_user_text.lstrip()
    head = text[:LOOKED_AT_CHARS]
    for agent, openings in OPENINGS.items():
        for opening, then in openings:
            if opening in head and (then is None or then in text[:FOLLOWS_WITHIN_CHARS]):
                return agent
    return None


# When even the largest window cannot hold the summary request, its tool outputs are masked (each keeps its head
# and tail, and its original is offloaded): first all but the newest three, then all but the newest, then all.
# A summary needs what each tool did, rarely every byte it printed; the agent's next turn starts from the summary.
# The last resort of a call its policy's context rules still leave over every window: an assistant turn over
# 2,000 tokens (an agent's runaway answer: 40-52k tokens in two of 20,163 replayed mini-swe-agent steps) gives way
# to a stub like a tool output's, its head and tail shown and the whole in the object store.
FIT_TURNS = MaskRule(keep_last=0, over_tokens=2_000, batch_tokens=0, head_chars=1_000, tail_chars=1_000)
FIT_RULES = (
    MaskRule(keep_last=3, over_tokens=200, batch_tokens=0),
    MaskRule(keep_last=1, over_tokens=200, batch_tokens=0),
    MaskRule(keep_last=0, over_tokens=100, batch_tokens=0, head_chars=300, tail_chars=300),
)
