"""Dead-loop detection over a session's recent steps, and the verdict the request path acts on.

    findings = loops(window, step, rules, steps_total)   # the flusher, once per recorded step
    verdict = verdict(active, loop_rules, spike_rules)    # the request path, from the session's active flags

A loop is the same tool call (name + argument digest), the same tool error fed back, or the same assistant
message sent back, `count` times within the last `window_steps` steps, or more steps than `max_steps`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gateway.agents.trajectory import Step
from gateway.policy.agents import LoopPolicy, Repeats, SpikePolicy

REPEATED_TOOL_CALL = "loop:repeated_tool_call"
REPEATED_TOOL_ERROR = "loop:repeated_tool_error"
REPEATED_OUTPUT = "loop:repeated_output"
STEP_LIMIT = "loop:step_limit"
SPIKE_SESSION = "spike:session"
SPIKE_TENANT = "spike:tenant"
STOP_CODES = {"loop": "agent_loop_detected", "spike": "agent_cost_spike"}
_Keys = Callable[[Step], list[str]]


@dataclass(frozen=True, slots=True)
class Finding:
    """One flag raised at a step, with what showed it."""

    flag: str
    detail: str


def rework(earlier: Sequence[Step], step: Step) -> bool:
    """Whether the step asks for a tool call (same name and arguments) the session already made."""
    keys = step.tool_call_keys
    if not keys:
        return False
    seen = {key for s in earlier for key in s.tool_call_keys}
    return any(key in seen for key in keys)


def loops(earlier: Sequence[Step], step: Step, rules: LoopPolicy, steps_total: int) -> list[Finding]:
    """The loops the session shows with `step` as its latest (earlier steps oldest first)."""
    found: list[Finding] = []
    if rules.repeated_tool_call is not None:
        found += _repeats(REPEATED_TOOL_CALL, rules.repeated_tool_call, earlier, step,
                          lambda s: [f"{name}(args {digest})" for name, digest in s.tool_call_keys])
    if rules.repeated_tool_error is not None:
        found += _repeats(REPEATED_TOOL_ERROR, rules.repeated_tool_error, earlier, step,
                          lambda s: [f"tool error {r.digest}" for r in s.tool_results if not r.ok])
    if rules.repeated_output is not None:
        found += _repeats(REPEATED_OUTPUT, rules.repeated_output, earlier, step,
                          lambda s: [f"assistant message {s.echo}"] if s.echo else [])
    if rules.max_steps is not None and steps_total > rules.max_steps:
        found.append(Finding(STEP_LIMIT, f"{steps_total} steps > max_steps {rules.max_steps}"))
    return found


def _repeats(flag: str, rule: Repeats, earlier: Sequence[Step], step: Step, keys: _Keys) -> list[Finding]:
    """Only the step that repeats raises the flag: one that moved on lets it lapse."""
    own = set(keys(step))
    if not own:
        return []
    window = [*earlier[max(0, len(earlier) - rule.window_steps + 1):], step]
    counts = Counter(key for s in window for key in keys(s) if key in own)
    key, count = counts.most_common(1)[0]
    if count < rule.count:
        return []
    return [Finding(flag, f"{key} {count} times in the last {len(window)} steps")]


@dataclass(frozen=True, slots=True)
class AgentVerdict:
    """What the request path does about a session's active flags."""

    flag: str  # the flag that decided the action
    action: str  # "escalate" | "steer" | "stop"
    target: str | None  # the deployment for escalate / steer
    detail: str
    retry_after_s: float = 0.0

    @property
    def code(self) -> str:
        return STOP_CODES[self.flag.split(":", 1)[0]]


def verdict(
    active: Mapping[str, tuple[float, str]], loops_rules: LoopPolicy, spikes: SpikePolicy, now: float
) -> AgentVerdict | None:
    """The action for a session's active flags ({flag: (until, detail)}): stop wins, then a loop's
    escalate, then a spike's steer; flags whose rule only flags, or whose time has passed, do nothing."""
    acting: list[AgentVerdict] = []
    for flag, (until, detail) in sorted(active.items()):
        if until <= now:
            continue
        if flag.startswith("loop:") and loops_rules.action != "flag":
            acting.append(AgentVerdict(flag, loops_rules.action, loops_rules.escalate_to, detail, until - now))
        elif flag.startswith("spike:") and spikes.action != "flag":
            acting.append(AgentVerdict(flag, spikes.action, spikes.steer_to, detail, until - now))
    if not acting:
        return None
    order = {"stop": 0, "escalate": 1, "steer": 2}
    return min(acting, key=lambda v: order[v.action])
