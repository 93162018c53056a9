"""deploy/'s Grafana dashboard and Prometheus alert rules: well formed, valid PromQL (promtool), their alerts
fire as meant (promtool's unit tests), and every metric they query exists on a running gateway's /metrics."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer

from fakes.faulty_vllm import Fault
from gateway.server.app import create_app
from gateway.server.settings import Settings
from tests.fixtures.agent_runs import Agent
from tests.fixtures.stack import ADMIN_TOKEN, OpsStack

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "agent-gateway.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (Debian's prometheus; scripts/setup)")

SCRAPE_LABELS = {"instance", "job", "pod"}  # added by Prometheus to every series it scrapes (pod: k8s relabel)
# Grafana's variables, as a query would be sent for "All" over a few hours.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$tenant": ".*"}


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel, the template variables' queries included."""
    board = json.loads(DASHBOARD.read_text())
    found = [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", [])]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((\w+), *\w+\)", variable["definition"])
            assert match, f"variable {variable['name']}: only label_values(metric, label) is expected"
            found.append((f"variable {variable['name']}", match.group(1)))
    return found


def alert_queries() -> list[tuple[str, str]]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [(rule["alert"], rule["expr"]) for group in rules["groups"] for rule in group["rules"]]


def grafana_to_promql(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


# --- PromQL, read just enough to name the series and labels a query uses ---

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{([^}]*)\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_WORD = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or",
             "unless", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The series a PromQL expression selects: words that are neither functions, keywords nor labels."""
    text = _GROUPING.sub(" ", _RANGE.sub(" ", _MATCHERS.sub(" ", _STRING.sub('""', grafana_to_promql(expr)))))
    names = set()
    for match in _WORD.finditer(text):
        if text[match.end():].lstrip().startswith("(") or match.group() in _KEYWORDS:
            continue  # a function or aggregation, or an operator
        names.add(match.group())
    return names


def label_names(expr: str) -> set[str]:
    """Labels a query matches on or groups by."""
    text = _STRING.sub('""', grafana_to_promql(expr))
    found = {m.group(1) for body in _MATCHERS.findall(text) for m in re.finditer(r"(\w+)\s*[!=]~?", body)}
    found |= {label.strip() for body in _GROUPING.findall(text) for label in body.split(",") if label.strip()}
    return found


def test_the_promql_reader_names_series_and_labels() -> None:
    expr = ('histogram_quantile(0.95, sum by (le, deployment) (rate(gateway_request_duration_seconds_bucket'
            '{endpoint="chat", rule=~"a|b"}[$__rate_interval]))) / ignoring (x) group_left sum(up) > bool 1')
    assert metric_names(expr) == {"gateway_request_duration_seconds_bucket", "up"}
    assert label_names(expr) == {"le", "deployment", "endpoint", "rule", "x"}


# --- the dashboard and the rules as files ---

def test_dashboard_is_well_formed() -> None:
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] == "agent-gateway" and board["schemaVersion"] >= 36
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "tenant"}
    cells: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        covered = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not covered & cells, f"{panel['title']} overlaps another panel"
        cells |= covered
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
        assert panel.get("description"), f"{panel['title']}: say what the panel shows"


def test_dashboard_covers_what_operators_watch() -> None:
    queried = {name for _, expr in dashboard_queries() for name in metric_names(expr)}
    for wanted in ("gateway_requests_total", "gateway_request_duration_seconds_bucket",
                   "gateway_time_to_first_token_seconds_bucket", "gateway_tenant_tokens_total",
                   "gateway_spend_usd_total", "gateway_rollout_weight_pct", "gateway_rollout_verdict",
                   "gateway_rollout_phase", "gateway_shadow_pairs_total", "gateway_agent_flags_total",
                   "gateway_agent_session_outcomes_total", "gateway_agent_session_outcome_cost_usd_total",
                   "gateway_agent_session_outcome_steps_total", "gateway_cached_tokens_total",
                   "gateway_compactions_total", "gateway_compaction_cost_usd_total",
                   "gateway_context_masked_tokens_saved_total", "gateway_context_offloads_total"):
        assert wanted in queried


def test_alerts_cover_loops_spikes_stale_state_and_aborts() -> None:
    exprs = dict(alert_queries())
    assert "gateway_agent_flags_total" in exprs["AgentDeadLoop"]
    assert "gateway_agent_flags_total" in exprs["AgentCostSpike"]
    assert "gateway_rollout_state_stale" in exprs["RolloutStateStale"]
    assert 'phase="Aborted"' in exprs["RolloutAborted"]


@needs_promtool
def test_alert_rules_are_valid_and_fire_as_meant() -> None:
    for args in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts.test.yml"]):
        out = subprocess.run([PROMTOOL or "", *args], cwd=ALERTS.parent, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """Each query, its Grafana variables filled in, checked by promtool as a recording rule."""
    rules = [{"record": f"dashboard:query_{i}", "expr": grafana_to_promql(expr)}
             for i, (_, expr) in enumerate(dashboard_queries())]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run([PROMTOOL or "", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


# --- against a running gateway ---

def exposition(text: str) -> tuple[dict[str, str], dict[str, set[str]]]:
    """The declared families ({name: type}) and each sample name's label names, from Prometheus text."""
    types: dict[str, str] = {}
    samples: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line and not line.startswith("#"):
            name, _, rest = line.partition("{")
            labels = set(re.findall(r'(\w+)="', rest.partition("}")[0])) if rest else set()
            samples.setdefault(name.split(" ")[0], set()).update(labels)
    return types, samples


def exists(name: str, types: dict[str, str], samples: dict[str, set[str]]) -> bool:
    """A queried name exists as a sample, a declared family, or a declared histogram's _bucket/_sum/_count."""
    if name in samples or name in types:
        return True
    base, _, suffix = name.rpartition("_")
    return suffix in ("bucket", "sum", "count") and types.get(base) == "histogram"


def labels_of(name: str, samples: dict[str, set[str]]) -> set[str] | None:
    return samples.get(name)


async def _traces_sink(aiohttp_server: Callable[..., Any]) -> str:
    async def accept(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/traces", accept)
    server: TestServer = await aiohttp_server(app)
    return str(server.make_url("/v1/traces"))


async def _scrape(url: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        return await resp.text()


async def _traffic(base_url: str, stack: OpsStack) -> None:
    """Every kind of request the panels chart: routed, pinned into the rollout, with tools, failed over, an
    agent that loops."""
    hello = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        for i in range(6):
            await client.chat.completions.create(model="hq", messages=hello, extra_headers={"x-session-id": f"s{i}"})
            await client.chat.completions.create(model="auto", messages=hello)
        await client.chat.completions.create(model="auto", messages=hello, tools=[tool])  # type: ignore[list-item]
        stream = await client.chat.completions.create(model="auto", messages=hello, stream=True)
        async for _ in stream:
            pass
        stack.fast.faults.append(Fault(status=500))
        await client.chat.completions.create(model="fast", messages=hello)  # fails over to hq
        # An agent fed the same tool error step after step: its loop flag is what the alerts count.
        await Agent(client, "looping", output=lambda _: "Error: index offline").run(4)
    # Its caller reports the run failed, then corrects itself: the outcome series and the replacement.
    async with aiohttp.ClientSession() as http:
        for success in (True, False):
            async with http.post(base_url + "/sessions/looping/outcome", json={"success": success}) as resp:
                assert resp.status == 200, await resp.text()


def _queries() -> Iterator[tuple[str, str]]:
    yield from dashboard_queries()
    yield from alert_queries()


async def test_every_queried_metric_exists_on_a_running_gateway(
    ops_stack: OpsStack, aiohttp_server: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", await _traces_sink(aiohttp_server))
    settings = Settings(policy=str(ops_stack.policy_path), admin_token=ADMIN_TOKEN, traces="otlp")
    gateway: TestServer = await aiohttp_server(create_app(settings))
    queried = {name: title for title, expr in _queries() for name in metric_names(expr)}
    deadline = time.monotonic() + 30
    while True:  # the rollout reaches 50% and its leader rules on the guards within a few ticks
        async with aiohttp.ClientSession() as http, http.get(
            gateway.make_url("/admin/rollouts/hq"), headers={"authorization": f"Bearer {ADMIN_TOKEN}"}
        ) as resp:
            if (await resp.json())["weight_pct"] == 50:
                break
        assert time.monotonic() < deadline, "the rollout did not start"
        await asyncio.sleep(0.1)
    await _traffic(str(gateway.make_url("/v1")), ops_stack)
    while True:
        types, samples = exposition(await _scrape(str(gateway.make_url("/metrics"))))
        if {"gateway_rollout_verdict", "gateway_shadow_pairs_total", "gateway_agent_flags_total"} <= samples.keys():
            break
        assert time.monotonic() < deadline, "no guard verdict, shadow pair or agent flag yet"
        await asyncio.sleep(0.1)
    missing = {name: title for name, title in queried.items() if not exists(name, types, samples)}
    assert missing == {}, "queried but not on /metrics"
    for title, expr in _queries():
        sampled = [labels_of(n, samples) for n in metric_names(expr) if labels_of(n, samples) is not None]
        if not sampled:
            continue  # only declared so far: its labels cannot be seen
        known = set().union(*(s or set() for s in sampled)) | {"le"} | SCRAPE_LABELS
        assert label_names(expr) <= known, f"{title}: {expr} uses labels {label_names(expr) - known}"
