// One run: its status, pinned version and hash, idempotency key, input,
// state, result or error, budgets as bars, the trace as a waterfall and the
// journal as a timeline.
//
// Live: every poll reads the small status (GET /v1/api/runs/{run}); the
// export (journal and spans) is read again only when `updated_at` moved.
// While the run is not over the waterfall is redrawn every poll (its running
// bars grow with the clock); once it is over, nothing changes any more (but
// for a new fork of it: the status's `forks` say so).
//
// For a key that may act (admin, or no keys on loopback: the actors page's
// rule) the Actions card offers what the run's status allows: Retry a failed
// run (POST .../retry, it resumes this run at the failed step), Fork from a
// completed step (POST .../fork, then the new run opens), Cancel a running
// one with a reason (POST .../cancel). Every answer or refusal is shown.

import {api, ApiError, refusal} from "./api.js";
import {h, fill, link, badge, facts, section, jsonBlock, table, statusBanner} from "./dom.js";
import {duration, time, toMs, num, usd, inline, clock, TERMINAL} from "./format.js";
import {buildTrace, renderTrace} from "./trace.js";

const MAX_JOURNAL_ROWS = 2000;
const BUDGETS = [
  ["max_transitions", "transitions", "transitions"],
  ["max_cost_units", "cost_units", "cost units"],
  ["max_state_bytes", "state_bytes", "state bytes"],
  ["max_started_workflows", "started_workflows", "child runs"],
  ["max_for_each_items", null, "for_each items"],
];

function budgetBars(budget) {
  const limits = (budget && budget.limits) || {};
  const usage = (budget && budget.usage) || {};
  return h("div", {class: "budgets"}, BUDGETS.map(([limitKey, useKey, label]) => {
    const limit = limits[limitKey];
    const used = useKey ? usage[useKey] ?? 0 : null;
    const track = h("div", {class: "meter"});
    let text;
    if (useKey === null) {
      text = limit === null || limit === undefined ? "no limit" : `≤ ${num(limit)} per for_each`;
      track.classList.add("na");
    } else if (limit === null || limit === undefined) {
      text = `${num(used)} · no limit`;
      track.classList.add("none");
    } else {
      const ratio = limit > 0 ? used / limit : (used > 0 ? 1 : 0);
      const fillEl = h("div", {class: `fill ${ratio >= 1 ? "over" : ratio >= 0.8 ? "high" : ""}`});
      fillEl.style.width = `${Math.min(100, ratio * 100).toFixed(1)}%`;
      track.append(fillEl);
      text = `${num(used)} / ${num(limit)}`;
    }
    return h("div", {class: "budget", dataset: {budget: limitKey}},
      h("span", {class: "label", title: limitKey}, label), track, h("span", {class: "value"}, text));
  }));
}

function usageTiles(usage) {
  const u = usage || {};
  return h("div", {class: "tiles"},
    h("div", {class: "tile"}, h("b", null, num(u.input_tokens ?? 0)), h("span", null, "input tokens")),
    h("div", {class: "tile"}, h("b", null, num(u.output_tokens ?? 0)), h("span", null, "output tokens")),
    h("div", {class: "tile"}, h("b", null, usd(u.cost_usd ?? 0)), h("span", null, "cost")));
}

const SKIP = new Set(["seq", "type", "at", "step_id", "item_index", "attempt", "worker_id", "worker_name", "fence", "lease_id"]);

function detail(e) {
  switch (e.type) {
    case "run_started":
      return `${e.workflow ?? ""} ${e.version ?? ""}${e.idempotency_key ? " · key " + e.idempotency_key : ""}`;
    case "step_scheduled":
      return `${e.kind ?? ""}${e.visit > 1 ? " · visit " + e.visit : ""}`;
    case "step_offered":
      return `lease ${e.lease_id ?? ""} · fence ${e.fence ?? ""}`;
    case "step_completed": {
      const u = e.usage;
      const parts = [];
      if (u && (u.input_tokens || u.output_tokens)) parts.push(`${num(u.input_tokens)} in · ${num(u.output_tokens)} out`);
      if (u && u.cost_usd) parts.push(usd(u.cost_usd));
      if (e.spans && e.spans.length) parts.push(`${e.spans.length} span${e.spans.length === 1 ? "" : "s"}`);
      return parts.join(" · ");
    }
    case "step_failed":
    case "step_unservable":
      return `${e.error_class ?? e.type.replace("step_", "")}: ${e.message ?? ""}`;
    case "state_patched":
      return Array.isArray(e.keys) ? `keys: ${e.keys.join(", ")}` : "";
    case "run_completed":
      return `result ${inline(e.result)}`;
    case "run_failed":
    case "run_cancelled":
    case "run_timed_out":
      return e.error ? `${e.error.reason ?? ""}${e.error.step_id ? " at " + e.error.step_id : ""}: ${e.error.message ?? ""}` : "";
    default: {
      const rest = {};
      for (const [k, v] of Object.entries(e)) if (!SKIP.has(k)) rest[k] = v;
      return Object.keys(rest).length ? inline(rest, 160) : "";
    }
  }
}

function eventClass(type) {
  if (/failed|exceeded|rejected|timed_out|orphaned|unservable|recovered|cancelled/.test(type)) return "ev bad";
  if (/completed/.test(type)) return "ev good";
  if (/^run_/.test(type)) return "ev run";
  if (/offered|started/.test(type)) return "ev work";
  return "ev";
}

function journalTable(journal) {
  const t0 = journal.length ? journal[0].at : 0;
  const names = new Map();
  for (const e of journal) if (e.type === "step_offered" && e.worker_id) names.set(e.worker_id, e.worker_name ?? e.worker_id);
  const rows = journal.slice(0, MAX_JOURNAL_ROWS).map((e) => {
    const item = e.item_index !== undefined && e.item_index !== null ? `[${e.item_index}]` : "";
    const worker = e.worker_name ?? (e.worker_id ? names.get(e.worker_id) ?? e.worker_id : "");
    return h("tr", {dataset: {seq: e.seq}},
      h("td", {class: "num muted"}, String(e.seq)),
      h("td", {class: "num nowrap", title: time(e.at)}, `+${duration(e.at - t0)}`),
      h("td", {class: "nowrap muted small"}, clock(e.at)),
      h("td", null, h("span", {class: eventClass(String(e.type))}, String(e.type))),
      h("td", {class: "mono small"}, e.step_id !== undefined ? `${e.step_id}${item}` : ""),
      h("td", {class: "num"}, e.attempt !== undefined ? String(e.attempt) : ""),
      h("td", {class: "small", title: e.worker_id ?? ""}, String(worker)),
      h("td", {class: "small wrap detail"}, detail(e)));
  });
  return [table(["#", "since start", "time", "event", "step", "try", "worker", "detail"], rows,
    {empty: "The journal is empty.", tableClass: "grid journal"}),
  journal.length > MAX_JOURNAL_ROWS ? h("p", {class: "muted small pad"},
    `${num(journal.length - MAX_JOURNAL_ROWS)} more events: stepd run journal shows them all.`) : null];
}

/** The step ids that completed as a whole (not for_each items): what a fork may start after. */
function completedSteps(journal) {
  const seen = [];
  for (const e of journal) {
    if (e.type === "step_completed" && (e.item_index === undefined || e.item_index === null)
        && e.step_id !== undefined && !seen.includes(e.step_id)) seen.push(e.step_id);
  }
  return seen;
}

function runLink(runId) {
  return link(["runs", runId], null, h("span", {class: "mono"}, runId));
}

/** Fork and retry links, both ways, and the cancel reason: facts beside the overview. */
function lineage(exp) {
  const s = exp.status;
  const from = exp.forked_from || s.forked_from;
  const forks = exp.forks || s.forks || [];
  const retries = (exp.journal || []).filter((e) => e.type === "run_retried");
  const pairs = [
    ["Forked from", from ? h("span", {class: "lineage", dataset: {link: "forked-from"}},
      runLink(from.run_id), " after step ", h("span", {class: "mono"}, from.step_id)) : null],
    ["Forks", forks.length ? h("ul", {class: "plain", dataset: {link: "forks"}}, forks.map((f) => h("li", null,
      runLink(f.run_id), h("span", {class: "muted small"}, " after step "), h("span", {class: "mono small"}, f.step_id)))) : null],
    ["Retried", retries.length ? h("ul", {class: "plain", dataset: {link: "retries"}}, retries.map((e) => h("li", null,
      "at step ", h("span", {class: "mono"}, e.step_id ?? ""), h("span", {class: "muted small"}, ` · ${time(e.at)}`),
      e.error && e.error.message ? h("span", {class: "muted small wrap"}, ` · had failed: ${e.error.message}`) : null))) : null],
    ["Cancel reason", s.status === "cancelled" && s.error
      ? h("span", {class: "wrap cancel-reason"}, s.error.message ?? "") : null],
  ];
  if (pairs.every(([, v]) => v === null)) return null;
  return section("Lineage", "retries resume this run; forks are new runs", facts(pairs));
}

function dataCard(title, value, note) {
  return h("section", {class: "card data"},
    h("div", {class: "card-head"}, h("h2", null, title), note ? h("span", {class: "note"}, note) : null),
    jsonBlock(value));
}

export function mount(view, params, ctx) {
  const runId = ctx.arg;
  const path = `/runs/${encodeURIComponent(runId)}`;
  const admin = ctx.session.role === "admin";
  const state = {updated: null, exp: null, open: new Set(), sig: "", actSig: "", armed: 0};
  const head = h("div");
  const {el: banner, say} = statusBanner();
  const actionsSlot = h("div");
  const body = h("div");
  const traceSlot = h("div");
  fill(view, h("nav", {class: "crumbs"}, link(["runs"], null, "Runs"), " / ", h("span", {class: "mono"}, runId)),
    head, banner, actionsSlot, body);


  function refused(what, err) {
    if (!ctx.failed(err)) say("bad", ...refusal(what, err));
  }

  async function reload() {
    state.updated = null;  // read the export again, whatever the status says
    await refresh().catch(() => {});
  }

  async function retry(button) {
    button.disabled = true;
    try {
      const answer = await api(`${path}/retry`, {method: "POST", body: {}});
      say("ok", "Retried at step ", h("span", {class: "mono"}, answer.step_id ?? ""), `: the run is ${String(answer.status).replace("_", " ")}.`);
    } catch (err) {
      refused("Retry", err);
    } finally {
      button.disabled = false;
      await reload();
    }
  }

  async function fork(stepId, button) {
    button.disabled = true;
    try {
      const answer = await api(`${path}/fork`, {method: "POST", body: {from_step: stepId}});
      if (!ctx.isCurrent()) return;
      location.hash = `#/runs/${encodeURIComponent(answer.run_id)}`;  // the new run's page
    } catch (err) {
      refused("Fork", err);
      button.disabled = false;
    }
  }

  async function cancel(reason, button) {
    button.disabled = true;
    try {
      await api(`${path}/cancel`, {method: "POST", body: reason ? {reason} : {}});
      say("ok", "Cancelled", reason ? [": ", h("span", {class: "wrap"}, reason)] : "", ".");
    } catch (err) {
      refused("Cancel", err);
    } finally {
      state.armed = 0;
      button.disabled = false;
      await reload();
    }
  }

  function renderActions() {
    if (!admin || !state.exp) return;
    const s = state.exp.status;
    const steps = completedSteps(state.exp.journal || []);
    const sig = JSON.stringify([s.status, steps]);
    if (sig === state.actSig) return;  // keeps a reason being typed, a step picked
    state.actSig = sig;
    state.armed = 0;
    const parts = [];
    if (s.status === "failed") {
      const button = h("button", {type: "button", class: "primary", dataset: {action: "retry"}}, "Retry");
      button.addEventListener("click", () => retry(button));
      parts.push(h("div", {class: "action"}, button,
        h("span", {class: "muted small"}, ` resumes this run at the step it failed on${s.error && s.error.step_id ? " (" + s.error.step_id + ")" : ""}, with a fresh retry budget`)));
    }
    if (steps.length) {
      const pick = h("select", {name: "from_step", "aria-label": "fork after step"},
        steps.map((id) => h("option", {value: id}, id)));
      pick.value = steps[steps.length - 1];
      const button = h("button", {type: "button", dataset: {action: "fork"}}, "Fork");
      button.addEventListener("click", () => fork(pick.value, button));
      parts.push(h("div", {class: "action"}, h("span", null, "Fork after step "), pick, " ", button,
        h("span", {class: "muted small"}, " a new run, with this run's journal up to that step")));
    }
    if (!TERMINAL.has(s.status)) {
      const reason = h("input", {name: "reason", maxlength: 1000, placeholder: "reason (optional)",
        autocomplete: "off", "aria-label": "cancel reason"});
      const button = h("button", {type: "button", class: "danger", dataset: {action: "cancel"}}, "Cancel run");
      button.addEventListener("click", () => {
        if (Date.now() - state.armed < 5000) { cancel(reason.value.trim(), button); return; }
        state.armed = Date.now();
        button.classList.add("armed");
        button.textContent = "Confirm cancel";
        setTimeout(() => {
          if (Date.now() - state.armed >= 5000) { button.classList.remove("armed"); button.textContent = "Cancel run"; }
        }, 5050);
      });
      parts.push(h("div", {class: "action"}, reason, " ", button));
    }
    fill(actionsSlot, parts.length ? h("section", {class: "card actions-card"},
      h("div", {class: "card-head"}, h("h2", null, "Actions")), parts) : null);
  }

  function drawTrace() {
    const exp = state.exp;
    const terminal = TERMINAL.has(exp.status.status);
    fill(traceSlot, renderTrace(buildTrace(exp.journal || [], exp.spans || [], Date.now(), terminal), state.open));
  }

  function render() {
    const exp = state.exp;
    const s = exp.status;
    const created = toMs(s.created_at);
    const ended = TERMINAL.has(s.status) ? toMs(s.updated_at) : Date.now();
    fill(head, h("div", {class: "run-head"},
      h("h1", {class: "mono"}, s.run_id), badge(s.status),
      h("span", {class: "muted"}, `${s.workflow} · ${s.definition_version ?? "no version"}`)));

    const overview = section("Run", null, facts([
      ["Workflow", link(["runs"], {workflow: s.workflow}, s.workflow)],
      ["Version", s.definition_version ?? "—"],
      ["Definition hash", h("span", {class: "mono wrap hash"}, s.definition_hash ?? "")],
      ["Idempotency key", s.idempotency_key ? h("span", {class: "mono wrap"}, s.idempotency_key) : "—"],
      ["Correlation", h("span", {class: "mono wrap"}, inline(s.correlation, 200))],
      ["Parent run", s.parent_run_id ? link(["runs", s.parent_run_id], null, h("span", {class: "mono"}, s.parent_run_id)) : null],
      ["Created", time(s.created_at)],
      ["Updated", time(s.updated_at)],
      [TERMINAL.has(s.status) ? "Took" : "Running for", duration(ended - created)],
      ["Current step", s.current_steps && s.current_steps.length ? h("span", {class: "mono"}, s.current_steps.join(", ")) : null],
      ["Waiting for", s.waiting_for ? h("span", null, "signal ", h("span", {class: "mono"}, s.waiting_for)) : null],
      ["Deadline", s.deadline_at ? time(s.deadline_at) : null],
    ]));
    const spend = section("Usage and budgets", null, usageTiles(s.usage), budgetBars(s.budget));
    const error = s.error ? h("section", {class: "card failure", role: "alert"},
      h("div", {class: "card-head"}, h("h2", null, "Error"), h("span", {class: "note mono"}, s.error.reason ?? "")),
      facts([["Reason", h("span", {class: "mono"}, s.error.reason ?? "")],
        ["Step", s.error.step_id ? h("span", {class: "mono"}, s.error.step_id) : null],
        ["Message", h("span", {class: "wrap"}, s.error.message ?? "")]])) : null;
    const spanCount = (exp.spans || []).length;
    const trace = section("Trace", `${num((exp.journal || []).filter((e) => e.type === "step_offered").length)} attempts · ${num(spanCount)} spans · click a row for details`, traceSlot);
    const data = h("div", {class: "cols3"},
      dataCard("Input", s.input),
      dataCard("State", s.state, s.budget && s.budget.usage ? `${num(s.budget.usage.state_bytes)} bytes` : null),
      s.status === "completed" ? dataCard("Result", s.result)
        : s.error ? dataCard("Error", s.error) : dataCard("Result", null, "not yet"));
    const journal = section("Journal", `${num((exp.journal || []).length)} events`, journalTable(exp.journal || []));
    fill(body, h("div", {class: "cols2"}, overview, spend), lineage(exp), error, trace, data, journal);
    drawTrace();
    renderActions();
  }

  async function refresh() {
    let status;
    try {
      status = await api(path);
    } catch (err) {
      if (err instanceof ApiError && err.status === 404) {
        fill(head, h("section", {class: "card notice"}, h("h2", null, "No such run"),
          h("p", null, err.message)));
        fill(body);
        return;
      }
      throw err;
    }
    if (!ctx.isCurrent()) return;
    const forks = (status.forks || []).length;
    const known = Math.min(100, ((state.exp && state.exp.forks) || []).length);
    if (!state.exp || status.updated_at !== state.updated || status.status !== state.exp.status.status
        || forks !== known) {
      const exp = await api(`${path}/export`);
      if (!ctx.isCurrent()) return;
      state.exp = exp;
      state.updated = exp.status.updated_at;
      render();
    } else if (!TERMINAL.has(status.status)) {
      drawTrace();
      state.exp.status = {...state.exp.status, ...status};
    }
  }

  return {refresh, unmount() {}};
}
