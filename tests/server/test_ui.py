"""The operators' page in a real headless browser (Debian's chromium via selenium) against a running gateway."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from selenium import webdriver
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException, TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from gateway.accounting import keys
from gateway.server.resources import STATE
from tests.fixtures.agent_runs import Agent, recorded
from tests.fixtures.agent_runs import admin as admin_get
from tests.fixtures.conditions import until
from tests.fixtures.stack import ADMIN_TOKEN, OpsStack, Stack
from tests.server.test_session_caches import RULES
from tests.server.test_warmups import OUTPUTS, WARM, Session, warmed_once

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="needs Debian's chromium and chromium-driver (scripts/setup installs them)",
)
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
HELLO = [{"role": "user", "content": "hi"}]
# Set to a file path to keep the screenshot of the signed-in page (to look at what an operator sees).
SCREENSHOT_ENV = "AGENT_GATEWAY_UI_SCREENSHOT"
STEPS = 4  # an agent run long enough for a repeated tool error (3 in a row) to be flagged


def _start_browser() -> WebDriver:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM or ""
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1440,1800", "--hide-scrollbars", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service(CHROMEDRIVER or ""))


@pytest.fixture
async def browser() -> AsyncIterator[WebDriver]:
    driver = await asyncio.to_thread(_start_browser)
    yield driver
    await asyncio.to_thread(driver.quit)


async def wait_for(driver: WebDriver, condition: Callable[[WebDriver], Any], timeout_s: float = 20) -> Any:
    """Selenium blocks: it waits in a thread while the test's event loop serves the gateway and the fakes."""
    wait = WebDriverWait(driver, timeout_s, poll_frequency=0.1,
                         ignored_exceptions=(NoSuchElementException, StaleElementReferenceException))
    try:
        return await asyncio.to_thread(wait.until, condition)
    except TimeoutException:
        page = await asyncio.to_thread(lambda: driver.find_element(By.TAG_NAME, "body").text)
        raise AssertionError(f"the page never met the condition; it shows:\n{page}") from None


def text_of(css: str) -> Callable[[WebDriver], str]:
    return lambda d: d.find_element(By.CSS_SELECTOR, css).text


async def admin(url: str, method: str = "GET", body: dict[str, Any] | None = None) -> Any:
    async with aiohttp.ClientSession() as http, http.request(method, url, json=body, headers=ADMIN) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def rollout_at(stack: OpsStack, weight_pct: float) -> None:
    deadline = time.monotonic() + 20
    while (await admin(stack.url("/admin/rollouts/hq")))["weight_pct"] != weight_pct:
        assert time.monotonic() < deadline, "the rollout did not reach its weight"
        await asyncio.sleep(0.1)


async def sign_in(driver: WebDriver, url: str, token: str = ADMIN_TOKEN) -> None:
    await asyncio.to_thread(driver.get, url)
    field = await wait_for(driver, lambda d: d.find_element(By.ID, "token") if d.find_element(
        By.ID, "login").is_displayed() else None)
    await asyncio.to_thread(field.send_keys, token + "\n")


async def open_session(browser: WebDriver, base: str, session: str) -> None:
    """Signed in, the session's row clicked: its timeline is shown."""
    await sign_in(browser, f"{base}/ui")
    row = f'#sessions tr[data-session="{session}"]'
    await wait_for(browser, text_of(row))
    await asyncio.to_thread(browser.find_element(By.CSS_SELECTOR, row).click)


async def test_without_the_token_the_page_shows_only_the_sign_in(ops_stack: OpsStack, browser: WebDriver) -> None:
    async with aiohttp.ClientSession() as http, http.get(ops_stack.url("/ui")) as resp:
        assert resp.status == 200 and "default-src 'none'" in resp.headers["content-security-policy"]
    await sign_in(browser, ops_stack.url("/ui"), token="not-the-token")
    error = await wait_for(browser, lambda d: d.find_element(By.ID, "login-error").text or None)
    assert "admin token" in error
    assert not browser.find_element(By.ID, "dashboard").is_displayed()
    assert browser.execute_script("return sessionStorage.length") == 0  # a refused token is not kept


async def test_the_page_shows_live_figures_and_aborts_a_rollout(ops_stack: OpsStack, browser: WebDriver,
                                                               tmp_path: Path) -> None:
    await rollout_at(ops_stack, 50)
    async with ops_stack.client() as client:
        for i in range(10):
            await client.chat.completions.create(model="hq", messages=HELLO, extra_headers={"x-session-id": f"s{i}"})
            await client.chat.completions.create(model="auto", messages=HELLO)
    await sign_in(browser, ops_stack.url("/ui"))

    # Deployments, shares against targets, the rollout, shadows and budgets, read from the gateway.
    await wait_for(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#deployments tr[data-deployment]")) == 3)
    health = browser.find_element(By.CSS_SELECTOR, '#deployments tr[data-deployment="fast"]').text
    assert "healthy" in health and "0 / 256" in health
    assert "in $0.5000 · out $1.50" in health and "cached in $0.0500" in health  # a tenth of the input price
    note = await wait_for(browser, text_of("#shares-note"))
    assert note.startswith("20 requests over the last")  # the server's first minute: since it started
    assert "target 50%" in browser.find_element(By.CSS_SELECTOR, '#shares [data-target="rollout:hq"]').text
    share = browser.find_element(By.CSS_SELECTOR, '#shares [data-target="share:auto"]').text
    assert "auto: top 30% to HQ (hard-prompt-to-hq)" in share and "target 30%" in share
    rollout = await wait_for(browser, text_of('#rollouts [data-route="hq"]'))
    assert "Paused" in rollout and "2 of 2" in rollout and "deployment:hq → deployment:hq-v2" in rollout
    assert "50.0%" in rollout
    await wait_for(browser, lambda d: d.find_element(By.CSS_SELECTOR, '#shadows tr[data-target="deployment:hq-v2"]'))
    budget = await wait_for(browser, text_of('#budgets tr[data-tenant="anonymous"][data-window="day"]'))
    assert "$1.00" in budget and "$2.00" in budget

    # Live: more traffic shows up at the next refresh without reloading the page.
    async with ops_stack.client() as client:
        for _ in range(5):
            await client.chat.completions.create(model="fast", messages=HELLO)
    await wait_for(browser, lambda d: int(d.find_element(By.ID, "shares-note").text.split()[0]) >= 25)

    shot = tmp_path / "ui.png"
    await asyncio.to_thread(browser.save_screenshot, str(shot))
    assert shot.stat().st_size > 20_000
    if os.environ.get(SCREENSHOT_ENV):
        shutil.copy(shot, os.environ[SCREENSHOT_ENV])

    # Abort, as an operator would: who and why, the button, the confirmation.
    actor = browser.find_element(By.ID, "actor")
    await asyncio.to_thread(actor.clear)
    await asyncio.to_thread(actor.send_keys, "alice\t")
    reason = browser.find_element(By.CSS_SELECTOR, '#rollouts [data-route="hq"] .actions input')
    await asyncio.to_thread(reason.send_keys, "answers look wrong")
    abort = browser.find_element(By.CSS_SELECTOR, '#rollouts button[data-route="hq"][data-action="abort"]')
    await asyncio.to_thread(abort.click)
    alert = await wait_for(browser, lambda d: d.switch_to.alert)
    assert "abort the rollout on route hq" in alert.text
    await asyncio.to_thread(alert.accept)
    await wait_for(browser, lambda d: "Aborted" in d.find_element(By.CSS_SELECTOR, '#rollouts [data-route="hq"]').text)
    state = await admin(ops_stack.url("/admin/rollouts/hq"))
    assert state["phase"] == "Aborted" and state["weight_pct"] == 0
    last = (await admin(ops_stack.url("/admin/rollouts/hq/history")))[-1]
    assert (last["action"], last["actor"], last["reason"]) == ("abort", "alice (ui)", "answers look wrong")


# The sessions API (GET /admin/sessions[/{id}]) comes with agent trajectories. Until it is in the gateway, a
# stub that answers its documented shape lets the page's list and timeline be checked against the contract.
def _stub_sessions(app: web.Application) -> None:
    now = time.time()
    summary = {"session_id": "run-42", "tenant": "acme", "steps": 2, "cost_usd": 0.0123, "tokens_in": 1200,
               "tokens_out": 300, "started_at": now - 20, "last_at": now - 5, "steps_per_min": 6.0,
               "deployments": {"hq": 1, "fast": 1}, "flags": ["repeated_tool_call"]}
    steps = [
        {"step": 1, "at": now - 20, "deployment": "hq", "rule": "tools-to-hq", "arm": None, "tokens_in": 500,
         "tokens_out": 120, "cost_usd": 0.0033, "latency_ms": 840, "ttft_ms": 210, "status": 200,
         "tool_calls": [{"name": "search", "args_digest": "9f2c"}], "tool_results": [], "flags": []},
        {"step": 2, "at": now - 5, "deployment": "fast", "rule": "default", "arm": None, "tokens_in": 700,
         "tokens_out": 180, "cost_usd": 0.009, "latency_ms": 320, "ttft_ms": 90, "status": 200,
         "tool_calls": [{"name": "search", "args_digest": "9f2c"}],
         "tool_results": [{"tool_call_id": "call_1", "ok": False, "size": 48}], "flags": ["repeated_tool_call"]},
    ]

    async def listing(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [summary]})

    async def one(request: web.Request) -> web.Response:
        return web.json_response({**summary, "steps": steps})

    app.router.add_get("/admin/sessions", listing)
    app.router.add_get("/admin/sessions/{session_id}", one)


async def test_the_sessions_list_opens_a_timeline(ops_stack: OpsStack, browser: WebDriver) -> None:
    # A real agent run through the gateway: each step asks for the same search and is fed the same error.
    error = "Error: the notes index is offline"
    ops_stack.hq.prefix_cache = ops_stack.fast.prefix_cache = True
    async with ops_stack.client() as client:
        await Agent(client, "run-42", output=lambda _: error).run(STEPS)
    recorded_run = await recorded(ops_stack.url("").rstrip("/"), "run-42", STEPS)
    assert "loop:repeated_tool_error" in recorded_run["flags"]
    async with aiohttp.ClientSession() as http, http.post(ops_stack.url("/v1/sessions/run-42/outcome"), json={
            "success": False, "reason": "the notes index never came back", "labels": {"task": "notes"}}) as resp:
        assert resp.status == 200

    await sign_in(browser, ops_stack.url("/ui"))
    row = await wait_for(browser, text_of('#sessions tr[data-session="run-42"]'))
    assert f"anonymous {STEPS} " in row and "loop:repeated_tool_error" in row and "failure" in row
    served = ", ".join(f"{d} {n}" for d, n in recorded_run["deployments"].items())
    assert served in row
    await asyncio.to_thread(browser.find_element(By.CSS_SELECTOR, '#sessions tr[data-session="run-42"]').click)
    timeline = await wait_for(browser, text_of("#timeline"))
    assert f"Session run-42 of anonymous · {STEPS} steps" in timeline
    assert timeline.count("→ search") == STEPS and timeline.count(f"← error {len(error)} B") == STEPS - 1
    cached = [s["tokens_cached"] for s in recorded_run["steps"] if s["tokens_cached"]]
    assert cached and all(f"{n} cached" in timeline for n in cached)  # the prefix-cache hits under each step
    assert f"Outcome: failure via api after {STEPS} steps" in timeline
    assert "the notes index never came back [task=notes]" in timeline
    # the outcome figures by route, deployment mix and arm
    mix = "+".join(sorted(recorded_run["deployments"]))
    figures = await wait_for(browser, text_of(f'#outcomes tr[data-route="auto"][data-mix="{mix}"][data-arm="none"]'))
    assert figures.split()[3:5] == ["1", "0.0%"] and figures.endswith("\u2013")  # no success: no cost per one
    if os.environ.get(SCREENSHOT_ENV):
        await asyncio.to_thread(browser.save_screenshot, os.environ[SCREENSHOT_ENV].replace(".png", "-sessions.png"))


TENANTS_POLICY = """
    auth: {enabled: true}
    agents:
      record: {max_sessions: 3}
"""


async def test_two_tenants_sessions_of_one_id_stay_apart_and_an_evicted_one_lets_go(
    make_stack: Callable[..., Any], browser: WebDriver,
) -> None:
    stack: Stack = await make_stack(TENANTS_POLICY)
    store = stack.gateway.app[STATE].accounting.store
    (_, acme), (_, globex) = await keys.create(store, "acme"), await keys.create(store, "globex")
    base = str(stack.gateway.make_url("")).rstrip("/")

    async def run(key: str, session: str, steps: int) -> None:
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key=key, max_retries=0) as client:
            await Agent(client, session).run(steps)

    await run(acme, "run-1", 2)
    await run(globex, "run-1", 3)  # the same x-session-id, another tenant
    await until(lambda: _listed(base, 2), what="both sessions are listed")
    await sign_in(browser, str(stack.gateway.make_url("/ui")))
    for tenant, steps in (("acme", 2), ("globex", 3)):
        row = f'#sessions tr[data-session="run-1"][data-tenant="{tenant}"]'
        await wait_for(browser, lambda d, row=row: d.find_element(By.CSS_SELECTOR, row))
        await asyncio.to_thread(browser.find_element(By.CSS_SELECTOR, row).click)
        timeline = await wait_for(browser, lambda d, t=tenant: (text := d.find_element(By.ID, "timeline").text)
                                  and f"of {t} ·" in text and text)
        assert f"Session run-1 of {tenant} · {steps} steps" in timeline
        assert timeline.count("→ search") == steps  # its own steps, not the other tenant's
    # acme's run-1 is selected; then acme starts two more sessions: beyond max_sessions (3) the largest
    # tenant's least recent session goes, acme's run-1, while globex keeps its own
    row = '#sessions tr[data-session="run-1"][data-tenant="acme"]'
    await asyncio.to_thread(browser.find_element(By.CSS_SELECTOR, row).click)
    await wait_for(browser, lambda d: "of acme ·" in d.find_element(By.ID, "timeline").text)
    await run(acme, "run-2", 1)
    await run(acme, "run-3", 1)
    gone = await wait_for(browser, lambda d: d.find_element(By.CSS_SELECTOR, '#timeline [data-expired="run-1"]').text)
    assert "run-1 of tenant acme is no longer recorded" in gone
    assert not browser.find_elements(By.CSS_SELECTOR, "#sessions tr.selected")
    await wait_for(browser, lambda d: not d.find_elements(By.CSS_SELECTOR, row))
    assert browser.find_elements(By.CSS_SELECTOR, '#sessions tr[data-session="run-1"][data-tenant="globex"]')
    assert "Could not load" not in browser.find_element(By.ID, "sessions").text
    status, _ = await admin_get(base, "/admin/sessions/run-1?tenant=acme")
    assert status == 404


async def _listed(base: str, count: int) -> bool:
    status, body = await admin_get(base, "/admin/sessions")
    return status == 200 and len(body["data"]) >= count


async def test_the_deployments_table_shows_streams_resumed_on_the_sibling(make_stack: Any, browser: WebDriver) -> None:
    from fakes.faulty_vllm import Fault

    stack: Stack = await make_stack()
    stack.fast.faults.append(Fault(drop_after_chunks=3))  # fast dies mid-answer: hq finishes it
    async with stack.client() as client:
        stream = await client.chat.completions.create(model="fast", messages=HELLO, stream=True)
        _ = [chunk async for chunk in stream]
    await sign_in(browser, str(stack.gateway.make_url("/ui")))

    def fast_row(d: WebDriver) -> str | None:
        text: str = d.find_element(By.CSS_SELECTOR, '#deployments tr[data-deployment="fast"]').text
        return text if "1 resumed" in text else None

    assert "1 resumed" in await wait_for(browser, fast_row)
    hq = browser.find_element(By.CSS_SELECTOR, '#deployments tr[data-deployment="hq"]').text
    assert "resumed" not in hq  # counted against the deployment that broke


async def test_the_timeline_shows_each_steps_prefix_caches_moves_and_warm_ups(
        make_stack: Callable[..., Any], browser: WebDriver) -> None:
    stack: Stack = await make_stack(rules=RULES, extra=WARM)
    session = Session(stack, "cached-run")
    await session.steps(6)  # step 5 stays on fast and warms hq
    await warmed_once(stack)
    assert await session.step(OUTPUTS[5]) == "hq"  # the warmed hq is cheap to move to
    base = str(stack.gateway.make_url("")).rstrip("/")
    await recorded(base, "cached-run", 7)
    await open_session(browser, base, "cached-run")

    def steps(d: WebDriver) -> list[str] | None:
        found = [row.text for row in d.find_elements(By.CSS_SELECTOR, "#timeline tr[data-step]")]
        return found if len(found) == 7 else None
    rows = await wait_for(browser, steps)
    assert "warm-up hq started" in rows[5] and "hq " in rows[5] and " uncached" in rows[5]
    assert "uncached (warmed)" in rows[6] and "moved from fast" in rows[6]


async def test_the_timeline_shows_what_a_compaction_cost_and_who_asked(
        make_stack: Callable[..., Any], browser: WebDriver) -> None:
    from tests.server.test_compaction import CONVERSATION, KEY, _summarizer

    stack: Stack = await make_stack(settings={"compaction_key": KEY})
    _summarizer(stack)
    settings: Any = {"context_management": [{"type": "compaction", "compact_threshold": 5}]}
    async with stack.client() as client:
        await client.responses.create(model="fast", input=CONVERSATION, extra_body=settings,  # type: ignore[arg-type]
                                      extra_headers={"x-session-id": "compacted-run"})
    base = str(stack.gateway.make_url("")).rstrip("/")
    await recorded(base, "compacted-run", 1)
    await open_session(browser, base, "compacted-run")
    shown = await wait_for(browser, text_of('#timeline tr[data-step] [data-compaction="context_management"]'))
    assert shown.startswith("compaction (context_management) $")


async def test_the_timeline_shows_each_steps_masked_tool_outputs(
        make_stack: Callable[..., Any], browser: WebDriver, tmp_path: Path) -> None:
    from tests.server.test_context_masking import chat_messages, client, context_policy, tenants

    stack: Stack = await make_stack(context_policy(tmp_path / "objects"))
    acme, _ = await tenants(stack)
    async with client(stack, acme) as sdk:
        await sdk.chat.completions.create(model="fast", max_tokens=16, messages=chat_messages(),
                                          extra_headers={"x-session-id": "masked-run"})
    base = str(stack.gateway.make_url("")).rstrip("/")
    await open_session(browser, base, "masked-run")
    shown = await wait_for(browser, text_of('#timeline tr[data-step] [data-masked="4"]'))
    assert shown.startswith("4 masked · ") and shown.endswith(" saved")


async def test_the_timeline_shows_each_steps_summarized_old_turns(
        make_stack: Callable[..., Any], browser: WebDriver, tmp_path: Path) -> None:
    from tests.server.test_context_masking import tenants
    from tests.server.test_old_turns import SUMMARY, conversation, is_summary_request, later, policy, step

    stack: Stack = await make_stack(policy(tmp_path / "objects"))
    stack.fast.answer = lambda body: SUMMARY if is_summary_request(body) else "tok tok"
    acme, _ = await tenants(stack)
    await step(stack, "chat", acme, conversation("chat"), "summarized-run")
    evictions = stack.gateway.app[STATE].evictions
    await until(lambda: evictions.ready_for("acme"), what="the summary kept")
    await step(stack, "chat", acme, later("chat", conversation("chat"), 1), "summarized-run")
    base = str(stack.gateway.make_url("")).rstrip("/")
    await recorded(base, "summarized-run", 2)
    await open_session(browser, base, "summarized-run")
    shown = await wait_for(browser, text_of('#timeline tr[data-step] [data-summarized="6"]'))
    assert shown.startswith("6 summarized · ") and shown.endswith(" saved")


async def test_the_timeline_shows_each_steps_retrieved_pieces(
        make_stack: Callable[..., Any], browser: WebDriver, tmp_path: Path) -> None:
    from tests.server.test_context_masking import tenants
    from tests.server.test_retrieval import ask, policy

    stack: Stack = await make_stack(policy(tmp_path / "objects"))
    acme, _ = await tenants(stack)
    await ask(stack, "chat", acme)
    library = stack.gateway.app[STATE].library
    await until(lambda: library.size == 3, what="the masked originals indexed")
    await ask(stack, "chat", acme)
    base = str(stack.gateway.make_url("")).rstrip("/")
    await recorded(base, "retrieval-chat", 2)
    await open_session(browser, base, "retrieval-chat")
    shown = await wait_for(browser, text_of('#timeline tr[data-step] [data-retrieved="1"]'))
    assert shown.startswith("1 retrieved · ") and shown.endswith(" tokens")
