"""The policy's context rules: off by default, the tenant's own over its route's over the policy's, errors that
name file, line, field and value; the object store's section."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from gateway.context.eviction import EvictRule
from gateway.context.masking import MaskRule
from gateway.policy import model
from gateway.policy.model import Policy, PolicyError


def _policy(**extra: Any) -> dict[str, Any]:
    routes = extra.pop("models", {"auto": {"route": "rules"}, "fast": {"pin": "fast"}})
    return {"deployments": {"fast": {"url": "http://127.0.0.1:1", "served_model": "f"},
                            "hq": {"url": "http://127.0.0.1:2", "served_model": "h"}},
            "models": routes, "default": "fast", **extra}


def test_masking_is_off_by_default() -> None:
    policy = Policy.model_validate(_policy())
    assert not policy.masks_context
    assert policy.mask_rule("auto", "acme") is None


@pytest.mark.parametrize(("route", "tenant", "keep_last"), [
    ("auto", None, 3),  # the policy's own
    ("fast", None, 5),  # the route's
    ("fast", "acme", 8),  # the tenant's wins over its route's
    ("auto", "globex", 9),  # the "*" template for tenants not listed
    ("hq", "quiet", None),  # a tenant that turned it off: `context: {}`
    ("unknown-model", None, 3),
])
def test_the_tenants_rule_over_the_routes_over_the_policys(route: str, tenant: str | None,
                                                           keep_last: int | None) -> None:
    policy = Policy.model_validate(_policy(
        context={"mask_tool_outputs": {}},
        models={"auto": {"route": "rules"}, "fast": {"pin": "fast", "context": {"mask_tool_outputs": {"keep_last": 5}}},
                "hq": {"pin": "hq"}},
        tenants=[{"name": "acme", "context": {"mask_tool_outputs": {"keep_last": 8}}},
                 {"name": "quiet", "context": {}},
                 {"name": "*", "context": {"mask_tool_outputs": {"keep_last": 9}}}]))
    assert policy.masks_context
    found = policy.mask_rule(route, tenant)
    assert (found.keep_last if found is not None else None) == keep_last
    if found is not None:
        assert found == MaskRule(keep_last, 200, 8_000, 600, 600)  # the documented defaults otherwise


def test_summaries_follow_the_same_precedence_and_a_section_turns_both_off() -> None:
    policy = Policy.model_validate(_policy(
        context={"summarize_old_turns": {}, "mask_tool_outputs": {}},
        models={"auto": {"route": "rules"}, "fast": {"pin": "fast", "context": {
            "summarize_old_turns": {"over_tokens": 30_000}}}},
        tenants=[{"name": "quiet", "context": {}}]))
    assert policy.summarizes_context
    assert policy.evict_rule("auto", None) == EvictRule(16_000, 4_000, 1_024)  # the documented defaults
    assert policy.evict_rule("fast", None) == EvictRule(30_000, 4_000, 1_024)
    assert policy.mask_rule("fast", None) is None  # the route's own section: masking not in it
    assert policy.evict_rule("auto", "quiet") is None and policy.mask_rule("auto", "quiet") is None
    assert not Policy.model_validate(_policy()).summarizes_context


@pytest.mark.parametrize(("section", "field", "value"), [
    ({"summarize_old_turns": {"over_tokens": 10}}, "context.summarize_old_turns.over_tokens", "10"),
    ({"summarize_old_turns": {"keep_tokens": "a few"}}, "context.summarize_old_turns.keep_tokens", "'a few'"),
    ({"mask_tool_outputs": {"keep_last": -1}}, "context.mask_tool_outputs.keep_last", "-1"),
    ({"mask_tool_outputs": {"batch_tokens": "lots"}}, "context.mask_tool_outputs.batch_tokens", "'lots'"),
    ({"mask_tool_outputs": {"keep_newest": 3}}, "context.mask_tool_outputs.keep_newest", "3"),
])
def test_a_bad_context_rule_names_file_line_field_and_value(section: dict[str, Any], field: str, value: str) -> None:
    text = yaml.safe_dump(_policy(context=section), sort_keys=False)
    with pytest.raises(PolicyError) as caught:
        model.parse(text, "policy.yaml")
    [problem] = caught.value.problems
    line = next(i for i, row in enumerate(text.splitlines(), 1) if field.rsplit(".", 1)[1] in row)
    assert problem.startswith(f"policy.yaml:{line}: {field}: ")
    assert f"(value: {value})" in problem


def test_a_summary_rule_with_no_room_to_grow_is_refused() -> None:
    text = yaml.safe_dump(_policy(context={"summarize_old_turns": {"over_tokens": 5_000, "keep_tokens": 4_500}}))
    with pytest.raises(PolicyError) as caught:
        model.parse(text, "policy.yaml")
    [problem] = caught.value.problems
    assert "context.summarize_old_turns" in problem and "must be more than keep_tokens + summary_tokens" in problem


def test_the_object_store_section() -> None:
    store = Policy.model_validate(_policy(store={"objects": {"s3": {"bucket": "ctx-shared", "endpoint": "http://s3"},
                                                             "ttl_s": 86400}})).store.objects
    assert store.s3 is not None and store.s3.bucket == "ctx-shared" and store.ttl_s == 86400
    with pytest.raises(PolicyError, match=r"store.objects.max_bytes"):
        model.parse(yaml.safe_dump(_policy(store={"objects": {"max_bytes": 10}})), "p.yaml")


def test_the_long_runs_policy_masks_and_summarizes_on_every_route() -> None:
    from pathlib import Path

    policy = model.load(Path(__file__).resolve().parents[2] / "policies" / "long-runs.yaml")
    assert policy.masks_context and policy.summarizes_context
    assert all(policy.mask_rule(route, None) == MaskRule(1, 4000, 0, 600, 600) for route in policy.models)
    assert all(policy.evict_rule(route, None) == EvictRule(12_000, 1_000, 512) for route in policy.models)
