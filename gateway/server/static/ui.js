// The operators' page: reads the gateway's admin API with the token kept in this tab's sessionStorage.
// Every figure is written with textContent (never innerHTML), so nothing a client sent can run here.
"use strict";

const TOKEN_KEY = "agent-gateway.admin-token";
const ACTOR_KEY = "agent-gateway.actor";
const REFRESH_MS = 3000;
const ACTIONS = {  // which manual operations make sense in each rollout phase
  Progressing: ["promote", "pause", "abort"],
  Paused: ["promote", "resume", "abort"],
  Aborted: ["retry"],
  Promoting: [],
  Healthy: [],
};

const $ = (id) => document.getElementById(id);
let timer = null;
let selectedSession = null;  // { tenant, id }: a session is named by both (two tenants may use one id)

class AuthError extends Error {}
class ApiError extends Error {
  constructor(status, message, code) { super(message); this.status = status; this.code = code; }
}

// --- the admin API ---

async function api(path, options = {}) {
  const headers = { authorization: `Bearer ${sessionStorage.getItem(TOKEN_KEY) || ""}` };
  if (options.body !== undefined) headers["content-type"] = "application/json";
  const resp = await fetch(path, { method: options.method || "GET", headers, body: options.body, cache: "no-store" });
  const body = await resp.json().catch(() => null);
  const error = body && body.error ? body.error : null;
  if (resp.status === 401 || resp.status === 403) throw new AuthError(error ? error.message : resp.statusText);
  if (!resp.ok) throw new ApiError(resp.status, error ? error.message : resp.statusText, error ? error.code : null);
  return body;
}

// --- small DOM builders ---

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "data") Object.assign(node.dataset, value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function pill(text, tone) { return el("span", { class: `pill ${tone || ""}` }, text); }
function num(value, digits = 0) { return value === null || value === undefined ? "–" : Number(value).toFixed(digits); }
function pct(value, digits = 0) { return value === null || value === undefined ? "–" : `${(value * 100).toFixed(digits)}%`; }
function usd(value) {
  if (value === null || value === undefined) return "–";
  return value >= 1 ? `$${value.toFixed(2)}` : `$${value.toFixed(4)}`;
}
function ago(seconds) {
  if (!seconds) return "–";
  const s = Math.max(0, Date.now() / 1000 - seconds);
  if (s < 60) return `${s.toFixed(0)} s ago`;
  if (s < 3600) return `${(s / 60).toFixed(0)} min ago`;
  return `${(s / 3600).toFixed(1)} h ago`;
}

function meter(fraction, tone, mark) {
  const fill = el("div", { class: `fill ${tone || ""}` });
  fill.style.width = `${Math.max(0, Math.min(1, fraction || 0)) * 100}%`;
  const node = el("div", { class: "meter" }, fill);
  if (mark !== undefined && mark !== null) {
    const line = el("div", { class: "mark", title: `target ${pct(mark)}` });
    line.style.left = `calc(${Math.max(0, Math.min(1, mark)) * 100}% - 1px)`;
    node.append(line);
  }
  return node;
}

function table(headings, rows, numeric = []) {
  const head = el("tr", {}, headings.map((h, i) => el("th", { class: numeric.includes(i) ? "num" : null }, h)));
  return el("table", {}, el("thead", {}, head), el("tbody", {}, rows));
}

function cells(values, numeric = []) {
  return values.map((v, i) => el("td", { class: numeric.includes(i) ? "num" : null }, v));
}

function fill(id, ...nodes) { $(id).replaceChildren(...nodes); }
function panelError(id, err) { fill(id, el("p", { class: "panel-error" }, `Could not load: ${err.message}`)); }

// --- panels ---

// Streams that broke mid-answer on a deployment: how many the sibling finished, and how many ended with the error.
function resumesCell(resumes) {
  const resumed = resumes.resumed || 0;
  const lost = (resumes.failed || 0) + (resumes.refused || 0);
  if (!resumed && !lost) return "0";
  const text = `${resumed} resumed` + (lost ? `, ${lost} not` : "");
  return el("span", { title: "broke after the first byte; resumed on the next deployment, or ended with the error event" },
    pill(text, lost ? "warn" : "ok"));
}

async function loadDeployments() {
  const view = await api("/admin/deployments");
  const worker = view.worker;
  $("deployments-note").textContent = worker.of > 1
    ? `answered by worker ${worker.index} of ${worker.of}; worker ${worker.prober} probes for all` : "";
  const rows = view.deployments.map((d) => {
    let health = pill("healthy", "ok");
    if (d.ejected_for_s > 0) health = pill(`ejected ${d.ejected_for_s.toFixed(0)} s`, "bad");
    else if (d.probe_ok === false) health = pill("failing checks", "bad");
    else if (d.healthy === null) health = pill("unknown");
    const kv = d.kv_cache_usage;
    return el("tr", { data: { deployment: d.name } }, cells([
      [el("strong", {}, d.name), el("span", { class: "sub-line mono" }, d.served_model)],
      health,
      `${d.in_flight} / ${d.max_in_flight}`,
      num(d.requests_running),
      num(d.requests_waiting),
      el("div", { title: pct(kv, 1) }, meter(kv, kv >= 0.9 ? "bad" : kv >= 0.75 ? "warn" : ""), el("span", { class: "sub-line" }, pct(kv, 1))),
      d.spec_acceptance === null ? "–" : pct(d.spec_acceptance),
      d.consecutive_failures ? pill(`${d.consecutive_failures} failing`, "warn") : "0",
      resumesCell(d.resumes || {}),
      el("span", { class: "share" }, pct(d.share, 1)),
      priceCell(d.price),
      ago(d.probed_at),
    ], [2, 3, 4, 6, 7, 8, 9]));
  });
  fill("deployments", table(
    ["deployment", "health", "in flight / max", "running", "waiting", "KV cache", "spec. accept.", "failures", "streams broken", "share", "USD / M tokens", "last check"],
    rows, [2, 3, 4, 6, 7, 8, 9]));
  renderShares(view);
}

// A deployment's prices per million tokens: input, cached input (a prefix-cache hit), output.
function priceCell(price) {
  if (!price) return "–";
  return [el("span", {}, `in ${usd(price.input_per_mtok_usd)} · out ${usd(price.output_per_mtok_usd)}`),
    el("span", { class: "sub-line" }, `cached in ${usd(price.cached_input_per_mtok_usd)}`)];
}

// A step's tokens: in / out, and under them how many of the input came from the deployment's prefix cache and
// how many the policy's context rules saved by masking old tool outputs and summarizing old turns.
function tokensCell(step) {
  const text = `${step.tokens_in} / ${step.tokens_out}`;
  const under = [];
  if (step.tokens_cached) under.push(el("span", { class: "sub-line" }, `${step.tokens_cached} cached`));
  const c = step.context;
  if (c && c.masked_outputs !== undefined) under.push(el("span", { class: "sub-line", data: { masked: c.masked_outputs } },
    `${c.masked_outputs} masked · ${c.tokens_saved} saved`));
  if (c && c.summarized_entries !== undefined) under.push(el("span", { class: "sub-line",
    data: { summarized: c.summarized_entries } }, `${c.summarized_entries} summarized · ${c.summary_tokens_saved} saved`));
  if (c && c.retrieved_pieces !== undefined) under.push(el("span", { class: "sub-line",
    data: { retrieved: c.retrieved_pieces } }, `${c.retrieved_pieces} retrieved · ${c.retrieved_tokens} tokens`));
  return under.length ? [el("span", {}, text), ...under] : text;
}

// A step's cost, and under it the part a compaction's summary took, with who asked for it.
function costCell(step) {
  const c = step.compaction;
  return c ? [el("span", {}, usd(step.cost_usd)),
    el("span", { class: "sub-line", data: { compaction: c.by } }, `compaction (${c.by}) ${usd(c.cost_usd)}`)]
    : usd(step.cost_usd);
}

function renderShares(view) {
  const shares = view.shares;
  $("shares-note").textContent = `${shares.requests} requests over the last ${shares.window_s.toFixed(0)} s`;
  const nodes = [];
  for (const [name, share] of Object.entries(shares.deployments)) {
    nodes.push(el("div", { class: "meter-row", data: { share: name } },
      el("span", { class: "label" }, name), meter(share), el("span", { class: "value" }, pct(share, 1))));
  }
  if (!nodes.length) nodes.push(el("p", { class: "empty" }, "No traffic in this window."));
  for (const t of view.targets) {
    const share = t.kind === "hq_share";
    const label = share
      ? `${t.route}: top ${pct(t.target)} to HQ${t.rules.length ? ` (${t.rules.join(", ")})` : ""}`
      : `rollout ${t.route} → ${t.candidate.replace(/^deployment:/, "")}`;
    const observed = t.observed === null ? "no traffic yet" : pct(t.observed, 1);
    const off = t.observed !== null && Math.abs(t.observed - t.target) > 0.1;
    const title = share ? `score threshold ${num(t.threshold, 4)} (${t.source})` : `phase ${t.phase}`;
    nodes.push(el("div", { class: "meter-row", title, data: { target: `${share ? "share" : "rollout"}:${t.route}` } },
      el("span", { class: "label", title: label }, label),
      meter(t.observed, off ? "warn" : "", t.target),
      el("span", { class: "value" }, `${observed} · target ${pct(t.target)}`)));
  }
  fill("shares", ...nodes);
}

async function loadRollouts() {
  const rollouts = await api("/admin/rollouts");
  const routes = Object.keys(rollouts);
  if (!routes.length) { fill("rollouts", el("p", { class: "empty" }, "No rollout is declared in the policy.")); return; }
  fill("rollouts", ...routes.map((route) => renderRollout(rollouts[route])));
}

function phaseTone(phase) {
  return { Healthy: "ok", Progressing: "", Promoting: "ok", Paused: "warn", Aborted: "bad" }[phase] || "";
}

function verdictTone(status) { return { pass: "ok", fail: "bad", inconclusive: "warn" }[status] || ""; }

function stepText(r) {
  if (!r.step) return r.step_index >= r.step_count ? "all steps done" : "–";
  const [kind, value] = Object.entries(r.step)[0];
  if (kind === "set_weight") return `set weight to ${value}%`;
  if (kind === "shadow") return `shadow ${value.percent}% of traffic`;
  if (kind === "pause") {
    const parts = [];
    if (value.duration_s) parts.push(`${value.duration_s} s`);
    if (value.until) parts.push(`${value.until.min_samples} samples`);
    return parts.length ? `pause for ${parts.join(" and ")}` : "pause until a human resumes or promotes";
  }
  if (kind === "analysis") {
    const guards = value.guards ? value.guards.join(", ") : "every guard";
    return `analysis of ${guards}${value.min_samples ? ` after ${value.min_samples} samples` : ""}`;
  }
  return `${kind} ${JSON.stringify(value)}`;
}

function renderRollout(r) {
  const reason = el("input", { placeholder: "reason (recorded in the rollout's history)", "aria-label": `reason for ${r.route}` });
  const buttons = (ACTIONS[r.phase] || []).map((action) => el("button", {
    type: "button",
    class: action === "abort" ? "danger" : "secondary",
    data: { route: r.route, action },
    onclick: () => act(r, action, reason.value),
  }, action[0].toUpperCase() + action.slice(1)));
  const verdicts = (r.metrics || []).map((v) => el("tr", {}, cells([
    v.metric, pill(v.status, verdictTone(v.status)), v.n, v.estimate === null ? "–" : num(v.estimate, 4),
    v.interval[0] === null ? "–" : `[${num(v.interval[0], 4)}, ${num(v.interval[1], 4)}]`, v.detail,
  ], [2, 3])));
  const replica = r.replica || {};
  return el("div", { class: "rollout", data: { route: r.route } },
    el("div", { class: "rollout-head" },
      el("span", { class: "route" }, r.route),
      el("span", { class: "mono" }, `${r.stable} → ${r.candidate}`),
      el("span", { class: "phase" }, pill(r.phase, phaseTone(r.phase))),
      replica.fresh === false ? pill("this replica's state is stale: it serves stable", "bad") : null),
    el("div", { class: "rollout-facts" },
      fact("step", `${Math.min(r.step_index + 1, r.step_count)} of ${r.step_count}: ${stepText(r)}`),
      fact("candidate weight", el("div", {}, meter(r.weight_pct / 100), el("span", { class: "sub-line weight" }, `${num(r.weight_pct, 1)}%`))),
      fact("samples (candidate / control)", `${r.samples.candidate} / ${r.samples.control}`),
      fact("in this step", `${num(r.step_age_s)} s${r.hold_s ? `, holding ${num(r.hold_s)} s` : ""} · generation ${r.generation}`)),
    verdicts.length ? table(["guard", "verdict", "n", "estimate", "interval", "detail"], verdicts, [2, 3]) : el("p", { class: "empty" }, "No guard has data yet."),
    r.reasons && r.reasons.length
      ? el("ul", { class: `reasons ${r.phase === "Aborted" ? "bad" : ""}` }, r.reasons.map((x) => el("li", {}, x))) : null,
    buttons.length ? el("div", { class: "actions" }, reason, ...buttons) : null);
}

function fact(label, value) {
  return el("div", { class: "fact" }, el("span", { class: "k" }, label), el("span", { class: "v" }, value));
}

async function act(r, action, reason) {
  const actor = $("actor").value.trim() || "operator";
  if (!window.confirm(`${action} the rollout on route ${r.route} (${r.candidate})?`)) return;
  try {
    await api(`/admin/rollouts/${encodeURIComponent(r.route)}/${action}`, {
      method: "POST",
      body: JSON.stringify({ actor: `${actor} (ui)`, reason: reason || `${action} from the operators' page`, generation: r.generation }),
    });
    setStatus(`${action} on ${r.route}: done`);
  } catch (err) {
    if (err instanceof AuthError) return signedOut(err.message);
    setStatus(`${action} on ${r.route} failed: ${err.message}`);
  }
  await refresh();
}

async function loadShadows() {
  const [pairs, policyShadow] = await Promise.all([api("/admin/shadow/pairs?limit=200"), api("/admin/shadow/policy")]);
  const byTarget = new Map();
  for (const p of pairs) {
    const t = byTarget.get(p.target) || { win: 0, tie: 0, loss: 0, similarity: [], last: 0, shadowFailed: 0 };
    t[p.outcome] = (t[p.outcome] || 0) + 1;
    if (p.similarity !== null && p.similarity !== undefined) t.similarity.push(p.similarity);
    if (p.shadow && p.shadow.ok === false) t.shadowFailed += 1;
    t.last = Math.max(t.last, p.at || 0);
    byTarget.set(p.target, t);
  }
  const rows = [...byTarget.entries()].map(([target, t]) => {
    const n = t.win + t.tie + t.loss;
    const stack = el("div", { class: "stack", title: `${t.win} wins, ${t.tie} ties, ${t.loss} losses` },
      ...["win", "tie", "loss"].map((k) => { const s = el("span", { class: k }); s.style.width = `${(t[k] / n) * 100}%`; return s; }));
    const sims = t.similarity.sort((a, b) => a - b);
    const median = sims.length ? sims[Math.floor(sims.length / 2)] : null;
    return el("tr", { data: { target } }, cells([
      el("span", { class: "mono" }, target), n, stack, `${t.win} / ${t.tie} / ${t.loss}`,
      median === null ? "–" : num(median, 3), t.shadowFailed, ago(t.last),
    ], [1, 4, 5]));
  });
  const nodes = rows.length
    ? [table(["target", "pairs", "outcome", "win / tie / loss", "median similarity", "shadow failed", "latest"], rows, [1, 4, 5]),
      el("p", { class: "legend" }, "the candidate's answer against the primary's:",
        ...["win", "tie", "loss"].map((k) => [el("span", { class: `key ${k}` }), k]))]
    : [el("p", { class: "empty" }, "No compared pairs yet.")];
  if (policyShadow.candidate) {
    const d = policyShadow.decisions || {};
    const total = Object.values(d).reduce((a, b) => a + b, 0);
    const agree = d.agree || 0;
    nodes.push(el("p", {}, "Policy shadow ", el("span", { class: "mono" }, policyShadow.candidate), ": ",
      total ? `${pct(agree / total, 1)} of ${total} decisions agree with the live policy on this replica` : "no decision yet",
      ` (${(policyShadow.disagreements || []).length} recent disagreements kept).`));
  }
  fill("shadows", ...nodes);
}

async function loadBudgets() {
  const usage = await api("/admin/usage");
  const totals = usage.data.filter((row) => row.deployment === "*");
  const rows = [];
  for (const [tenant, budgets] of Object.entries(usage.limits || {})) {
    const mine = totals.filter((r) => r.tenant === tenant);
    // The windows a limit applies to; a tenant without any shows its day's spend.
    const shown = budgets.length ? mine.filter((r) => budgets.some((b) => b.window === r.window)) : mine.filter((r) => r.window === "day");
    for (const row of shown) rows.push(budgetRow(tenant, row, budgets.find((b) => b.window === row.window) || {}));
  }
  fill("budgets", rows.length
    ? table(["tenant", "window", "spent", "soft", "hard", "of the limit", "requests", "tokens in / out"], rows, [2, 3, 4, 6, 7])
    : el("p", { class: "empty" }, "No spend recorded yet."));
}

function budgetRow(tenant, row, budget) {
  const limit = budget.hard_usd || budget.soft_usd;
  const used = limit ? row.spend_usd / limit : null;
  const overSoft = budget.soft_usd !== undefined && row.spend_usd >= budget.soft_usd;
  const softMark = budget.soft_usd && budget.hard_usd ? budget.soft_usd / budget.hard_usd : null;
  const gauge = limit
    ? el("div", { class: "used" }, meter(used, used >= 1 ? "bad" : overSoft ? "warn" : "", softMark), el("span", { class: "sub-line" }, pct(used, 1)))
    : "no limit";
  return el("tr", { data: { tenant, window: row.window } }, cells([
    el("strong", {}, tenant), row.window, usd(row.spend_usd),
    budget.soft_usd === undefined ? "–" : usd(budget.soft_usd), budget.hard_usd === undefined ? "–" : usd(budget.hard_usd),
    gauge, row.requests, `${row.tokens_in} / ${row.tokens_out}`,
  ], [2, 3, 4, 6, 7]));
}

async function loadSessions() {
  const params = new URLSearchParams({ sort: $("sessions-sort").value, limit: "50" });
  const tenant = $("sessions-tenant").value.trim();
  if (tenant) params.set("tenant", tenant);
  const list = await api(`/admin/sessions?${params}`);
  const rows = list.data.map((s) => el("tr", {
    class: `clickable ${isSelected(s) ? "selected" : ""}`,
    data: { session: s.session_id, tenant: s.tenant },
    onclick: () => {
      selectedSession = { tenant: s.tenant, id: s.session_id };
      loadSessions().catch((e) => panelError("sessions", e));
    },
  }, cells([
    el("span", { class: "mono" }, s.session_id), s.tenant, s.steps, usd(s.cost_usd), `${s.tokens_in} / ${s.tokens_out}`,
    num(s.steps_per_min, 1), Object.entries(s.deployments || {}).map(([d, n]) => `${d} ${n}`).join(", "),
    (s.flags || []).map((f) => pill(flagText(f), "bad")), outcomePill(s.outcome), ago(s.last_at),
  ], [2, 3, 5])));
  fill("sessions", rows.length
    ? table(["session", "tenant", "steps", "cost", "tokens in / out", "steps/min", "deployments", "flags", "outcome", "last step"], rows, [2, 3, 5])
    : el("p", { class: "empty" }, "No agent session recorded yet."));
  if (selectedSession) await loadTimeline(selectedSession);
}

function outcomePill(outcome) {
  if (!outcome) return "–";
  const word = outcome.success ? "success" : "failure";
  const node = pill(outcome.score === null || outcome.score === undefined ? word : `${word} ${num(outcome.score, 2)}`,
    outcome.success ? "ok" : "bad");
  if (outcome.reason) node.title = outcome.reason;
  return node;
}

function outcomeText(s) {
  const o = s.outcome;
  if (!o) return "Outcome not reported.";
  const labels = Object.entries(o.labels || {}).map(([k, v]) => `${k}=${v}`).join(", ");
  const earlier = (s.outcome_history || []).length;
  return [`Outcome: ${o.success ? "success" : "failure"}`, o.score === null ? "" : ` (score ${num(o.score, 2)})`,
    ` via ${o.source} after ${o.steps} steps and ${usd(o.cost_usd)}`, o.reason ? `: ${o.reason}` : "",
    labels ? ` [${labels}]` : "", earlier ? ` · replaces ${earlier} earlier report${earlier > 1 ? "s" : ""}` : ""].join("");
}

async function loadOutcomes() {
  const tenant = $("sessions-tenant").value.trim();
  const found = await api(`/admin/outcomes${tenant ? `?tenant=${encodeURIComponent(tenant)}` : ""}`);
  const rows = found.data.map((r) => el("tr", { data: { route: r.route, mix: r.mix, arm: r.arm } }, cells([
    r.route, r.mix, r.arm, r.sessions, pct(r.success_rate, 1), usd(r.cost_per_session_usd),
    usd(r.cost_per_success_usd), num(r.steps_per_success, 1),
  ], [3, 4, 5, 6, 7])));
  fill("outcomes", rows.length
    ? table(["route", "deployments", "arm", "sessions", "success rate", "cost / session", "cost per solved task",
      "steps per success"], rows, [3, 4, 5, 6, 7])
    : el("p", { class: "empty" }, "No session has reported its outcome yet (POST /v1/sessions/{id}/outcome)."));
}

function isSelected(s) {
  return selectedSession !== null && s.session_id === selectedSession.id && s.tenant === selectedSession.tenant;
}

function flagText(flag) {
  if (typeof flag === "string") return flag;
  return [flag.kind || flag.type || "flag", flag.action].filter(Boolean).join(": ");
}

async function loadTimeline(selected) {
  const { tenant, id } = selected;
  let s;
  try {
    s = await api(`/admin/sessions/${encodeURIComponent(id)}?${new URLSearchParams({ tenant })}`);
  } catch (err) {
    if (!(err instanceof ApiError) || err.status !== 404) throw err;
    // Idle past the policy's ttl_s, or evicted: say so once and let go of it, not a 404 at every refresh.
    if (selectedSession === selected) selectedSession = null;
    for (const row of document.querySelectorAll("#sessions tr.selected")) row.classList.remove("selected");
    fill("timeline", el("p", { class: "empty", data: { expired: id } },
      `Session ${id} of tenant ${tenant} is no longer recorded (it expired or was evicted); pick another.`));
    return;
  }
  const start = s.started_at || (s.steps.length ? s.steps[0].at : 0);
  const rows = s.steps.map((step) => el("tr", { data: { step: step.step } }, cells([
    step.step, `+${num(step.at - start, 1)} s`, step.deployment, step.rule, step.arm || "–",
    tokensCell(step), costCell(step), num(step.latency_ms), num(step.ttft_ms),
    pill(String(step.status), String(step.status).startsWith("2") ? "ok" : "bad"),
    [...(step.tool_calls || []).map((c) => pill(`→ ${c.name}`)),
      ...(step.tool_results || []).map((r) => pill(`← ${r.ok ? "ok" : "error"} ${r.size} B`, r.ok ? "ok" : "bad"))],
    (step.flags || []).map((f) => pill(flagText(f), "bad")),
    cacheCell(step.cache),
  ], [0, 1, 6, 7, 8])));
  fill("timeline",
    el("h3", {}, "Session ", el("span", { class: "mono" }, id), ` of ${tenant} · ${s.steps.length} steps · ${usd(s.cost_usd)}`),
    el("p", { class: "outcome", id: "timeline-outcome" }, outcomeText(s)),
    table(["step", "at", "deployment", "rule", "arm", "tokens in / out", "cost", "latency ms", "TTFT ms", "status", "tools", "flags", "prefix cache"], rows, [0, 1, 6, 7, 8]));
}

// A step's prefix caches (policy `switch`): per deployment the prompt tokens it held / would prefill, as predicted
// before the step (what the deployment reported, when it did), the move, the warm-up the step started.
function cacheCell(cache) {
  if (!cache) return "–";
  const warmed = new Set(cache.warmed || []);
  const lines = Object.entries(cache.cached_tokens).map(([name, held]) => el("span", { class: "sub-line" },
    `${name} ${held.toLocaleString()} cached / ${(cache.uncached_tokens[name] || 0).toLocaleString()} uncached${warmed.has(name) ? " (warmed)" : ""}`));
  if (cache.reported_cached_tokens !== null && cache.reported_cached_tokens !== undefined) {
    lines.push(el("span", { class: "sub-line" }, `reported ${cache.reported_cached_tokens.toLocaleString()} cached`));
  }
  if (cache.switched_from) lines.push(pill(`moved from ${cache.switched_from}`));
  const warm = cache.warm_up;
  if (warm) lines.push(pill(`warm-up ${warm.deployment} ${warm.outcome}`, warm.outcome === "started" ? "ok" : "warn"));
  return lines;
}

// --- refresh, sign-in ---

function setStatus(text) { $("status").textContent = text; }

async function refresh() {
  clearTimeout(timer);
  const panels = [["deployments", loadDeployments], ["rollouts", loadRollouts], ["shadows", loadShadows],
    ["budgets", loadBudgets], ["sessions", loadSessions], ["outcomes", loadOutcomes]];
  const results = await Promise.allSettled(panels.map(([, load]) => load()));
  const denied = results.find((r) => r.status === "rejected" && r.reason instanceof AuthError);
  if (denied) return signedOut(denied.reason.message);
  results.forEach((r, i) => { if (r.status === "rejected") panelError(panels[i][0], r.reason); });
  setStatus(`updated ${new Date().toLocaleTimeString()}`);
  timer = setTimeout(refresh, REFRESH_MS);
}

function signedOut(message) {
  clearTimeout(timer);
  sessionStorage.removeItem(TOKEN_KEY);
  $("dashboard").hidden = true;
  $("who").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  setStatus("");
  $("token").focus();
}

async function signIn(token) {
  sessionStorage.setItem(TOKEN_KEY, token);
  try {
    await api("/admin/policy");
  } catch (err) {
    return signedOut(err instanceof AuthError ? err.message : `The admin API did not answer: ${err.message}`);
  }
  $("login").hidden = true;
  $("dashboard").hidden = false;
  $("who").hidden = false;
  await refresh();
}

document.addEventListener("DOMContentLoaded", () => {
  $("actor").value = sessionStorage.getItem(ACTOR_KEY) || "operator";
  $("actor").addEventListener("change", () => sessionStorage.setItem(ACTOR_KEY, $("actor").value.trim()));
  $("login-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const token = $("token").value.trim();
    $("token").value = "";
    signIn(token);
  });
  $("signout").addEventListener("click", () => signedOut("Signed out."));
  $("refresh").addEventListener("click", () => refresh());
  $("sessions-form").addEventListener("submit", (event) => event.preventDefault());
  $("sessions-sort").addEventListener("change", () => loadSessions().catch((e) => panelError("sessions", e)));
  $("sessions-tenant").addEventListener("change", () => loadSessions().catch((e) => panelError("sessions", e)));
  $("sessions-tenant").addEventListener("change", () => loadOutcomes().catch((e) => panelError("outcomes", e)));
  document.addEventListener("visibilitychange", () => { if (!document.hidden && !$("dashboard").hidden) refresh(); });
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) signIn(token); else signedOut("");
});
