"""The request path's one hook: a request of an experimental policy gets its arm, its shadows and the policy
shadow's decision at `begin`, and its sample and log line at `finished`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from gateway.experiments.hook import Experiments
from gateway.experiments.request_log import RequestLog
from gateway.experiments.rollouts import Rollouts
from gateway.experiments.shadows import Shadows
from gateway.rollout.samples import Cohort
from gateway.rollout.step import start
from gateway.store.pairs import MemoryShadowPairStore
from gateway.store.rollout_memory import MemoryRolloutStore
from gateway.telemetry.metrics import make_metrics
from gateway.upstream.client import Pool
from tests.fixtures.enrolled import call_of, enrollment_of, policy_of

SECTIONS = {
    "rollouts": [{"id": "r1", "route": "hq", "candidate": "deployment:hq-v2", "stable": "deployment:hq",
                  "steps": [{"set_weight": 100}]}],
    "shadows": [{"route": "hq", "target": "deployment:fast", "percent": 100}],
    "policies": {"all-fast": {"rules": [], "default": "fast"}},
    "policy_shadow": {"candidate": "all-fast", "percent": 100},
}


async def test_a_request_gets_its_arm_shadow_and_policy_shadow_then_its_sample_and_line(tmp_path: Path) -> None:
    policy, store, metrics = policy_of(SECTIONS), MemoryRolloutStore(), make_metrics()
    rollouts = Rollouts(store, lambda: policy, metrics)
    state = dataclasses.replace(start("r1", 0.0), weight_pct=100.0)
    await store.write_state("hq", -1, state, 0)
    await rollouts.view.refresh()
    log = RequestLog(str(tmp_path / "requests.jsonl"))
    experiments = Experiments(rollouts, Shadows(Pool(), MemoryShadowPairStore(), metrics), metrics, log)
    live, ctx = enrollment_of(call_of(policy, "hq", user="alice"))
    enrollment = await experiments.begin(live.ex, live.call, ctx, live.decision)
    assert enrollment.decision.deployment == "hq-v2" and enrollment.cohort is Cohort.CANDIDATE
    assert len(enrollment.shadows) == 1  # the standing shadow onto fast
    assert experiments.agreement == {"disagree": 1}  # all-fast would have sent it to fast
    enrollment.forwarded, enrollment.ex.deployment = True, "hq-v2"
    experiments.finished(enrollment, 200)
    await rollouts.flush()
    assert (await rollouts.counters.observe(state)).candidate.requests == 1
    await log.flush()
    line = json.loads((tmp_path / "requests.jsonl").read_text())
    assert (line["arm"], line["served_by"], line["status"]) == ("candidate", "hq-v2", 200)


async def test_a_policy_without_experiments_is_only_logged() -> None:
    policy, metrics = policy_of(), make_metrics()
    rollouts = Rollouts(MemoryRolloutStore(), lambda: policy, metrics)
    experiments = Experiments(rollouts, Shadows(Pool(), MemoryShadowPairStore(), metrics), metrics)
    assert not experiments.engaged(policy)
    live, ctx = enrollment_of(call_of(policy, "hq"))
    enrollment = await experiments.begin(live.ex, live.call, ctx, live.decision)
    assert enrollment.decision == live.decision and enrollment.shadows == [] and enrollment.cohort is None
