"""The `x-session-outcome` header shortcut: the recorder sets the outcome once it has recorded the step.

The request handler reads the header (decision.outcomes.read_header) and hands it to Trajectories.begin;
here the step is begun as the handler does, on a running gateway's recorder and store.
"""

from __future__ import annotations

from gateway.decision.outcomes import read_header
from gateway.decision.routing import Decision
from gateway.features import extract
from gateway.openai import Usage
from gateway.server.resources import POLICY, TELEMETRY, TRAJECTORIES
from gateway.telemetry.exchange import Exchange
from tests.fixtures.agent_runs import TOOLS, admin
from tests.fixtures.stack import Stack, metric


async def test_the_last_steps_header_sets_the_outcome_once_the_step_is_recorded(stack: Stack) -> None:
    app = stack.gateway.app
    trajectories, policy, metrics = app[TRAJECTORIES], app[POLICY].current, app[TELEMETRY].metrics
    body = {"model": "auto", "tools": TOOLS, "messages": [{"role": "user", "content": "do the task"}]}
    for i, header in enumerate(({}, {"x-session-outcome": "failure"})):
        ex = Exchange(f"req-{i}", "chat")
        ex.decided(extract(body, "chat"), Decision("hq", "tools-to-hq", ("hq",)), None)
        trajectories.begin(ex, policy, "anonymous", "h:hdr", body, extract(body, "chat"), None,
                           outcome=read_header(header))
        ex.answered("hq", "fake-hq", policy.deployments["hq"].price)
        ex.settle(Usage(100, 20), metrics)
        ex.finish(200, metrics, None)
        await trajectories.flush()
        status, shown = await admin(str(stack.gateway.make_url("")).rstrip("/"), "/admin/sessions/h:hdr")
        assert status == 200 and shown["step_count"] == i + 1
    assert shown["outcome"]["success"] is False and shown["outcome"]["source"] == "header"
    assert shown["outcome"]["steps"] == 2  # set after the step that carried it was recorded
    assert shown["outcome"]["cost_usd"] == shown["cost_usd"] > 0
    assert await metric(stack.gateway, "gateway_agent_session_outcomes_total", outcome="failure", mix="hq") == 1
