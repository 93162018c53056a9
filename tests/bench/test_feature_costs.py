"""The feature-cost ladder takes away one feature a rung, and every rung is a policy the gateway serves."""

from __future__ import annotations

from pathlib import Path

import yaml

from bench import feature_costs
from gateway.policy.model import parse

ROOT = Path(__file__).resolve().parents[2]


def test_each_rung_takes_away_one_more_feature_and_is_a_valid_policy() -> None:
    source = yaml.safe_load((ROOT / "policies" / "default.yaml").read_text())
    rungs = feature_costs.rung_policies(source, "http://127.0.0.1:9")
    assert [name for name, _, _ in rungs][1:] == [f"- {name}" for name, _ in feature_costs.LADDER]
    policies = [parse(yaml.safe_dump(policy)) for _, policy, _ in rungs]
    assert [spans for _, _, spans in rungs] == [True, False, False, False, False, False]
    first, *_, last = policies
    assert first.switch is not None and first.agents.record.enabled and first.rules
    assert last.switch is None and not last.agents.record.enabled and not last.rules
    assert not last.resume_for("auto").enabled
    assert [p.switch is None for p in policies] == [False, False, True, True, True, True]
    assert all(dep.url == "http://127.0.0.1:9" for p in policies for dep in p.deployments.values())
    assert source["switch"]  # the source policy is left as it was
