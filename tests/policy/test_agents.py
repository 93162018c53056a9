"""The policy's agents section: defaults, per-tenant overrides, located errors, deployment references."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.policy import model as policy

ROOT = Path(__file__).resolve().parents[2]
BASE = (ROOT / "policies" / "default.yaml").read_text()

AGENTS = """
agents:
  record: {max_steps_per_session: 100, ttl_s: 3600}
  loops:
    action: escalate
    repeated_tool_call: {count: 4, window_steps: 8}
  spikes: {factor: 3}
  tenants:
    acme:
      loops: {action: stop, max_steps: 40}
    "*":
      spikes: {action: steer}
"""


def test_defaults_record_and_only_flag() -> None:
    agents = policy.parse(BASE).agents
    assert agents.record.enabled and agents.record.max_sessions == 10_000
    assert (agents.loops.action, agents.spikes.action) == ("flag", "flag") and not agents.enforcing
    assert agents.loops.repeated_tool_call is not None and agents.loops.repeated_tool_call.count == 5


def test_a_tenant_override_replaces_only_what_it_gives() -> None:
    agents = policy.parse(BASE + AGENTS).agents
    loops, spikes = agents.for_tenant("acme")
    assert (loops.action, loops.max_steps, loops.escalate_to) == ("stop", 40, "hq")
    assert loops.repeated_tool_call is not None and loops.repeated_tool_call.count == 4  # the section's own
    assert (spikes.action, spikes.factor) == ("flag", 3)
    other_loops, other_spikes = agents.for_tenant("globex")  # the "*" template
    assert (other_loops.action, other_spikes.action, other_spikes.factor) == ("escalate", "steer", 3)
    assert agents.enforcing


def _problems(text: str) -> list[str]:
    with pytest.raises(policy.PolicyError) as caught:
        policy.parse(text, "p.yaml")
    return caught.value.problems


def test_errors_name_file_line_field_and_value() -> None:
    text = BASE + AGENTS.replace("action: stop", "action: halt")
    line = text.splitlines().index("      loops: {action: halt, max_steps: 40}") + 1
    (problem,) = _problems(text)
    assert problem.startswith(f"p.yaml:{line}: agents.tenants.acme.loops.action:") and "'halt'" in problem
    (problem,) = _problems(BASE + AGENTS.replace("{count: 4, window_steps: 8}", "{count: 4, window_steps: 3}"))
    assert "agents.loops.repeated_tool_call" in problem and "window_steps 3 is smaller than count 4" in problem


def test_an_acting_rule_must_name_a_known_deployment() -> None:
    (problem,) = _problems(BASE + AGENTS.replace("action: escalate", "action: escalate\n    escalate_to: hq-v9"))
    assert "agents.loops.escalate_to: unknown deployment 'hq-v9'" in problem
    # a flag-only rule's target is never used: no error
    policy.parse(BASE + "agents: {spikes: {steer_to: nowhere}}\n")
