// Runs: newest first, filters, live counts by status, "more" by cursor.
//
// The filters live in the URL (#/runs?workflow=...&status=...), so a filtered
// list can be bookmarked or shared. GET /v1/api/runs may answer fewer runs
// than `limit` while `next_cursor` is set (the daemon bounds a page's work):
// "More" follows the cursor. Live updates re-read the first page and merge it
// by run id, so runs loaded with "More" stay, with their last known status.

import {api, ApiError} from "./api.js";
import {h, fill, link, badge, table} from "./dom.js";
import {ago, time, toMs, num, STATUSES, localInput} from "./format.js";

const PAGE = 50;
const SINCE = {"15m": 15 * 60_000, "1h": 3_600_000, "24h": 86_400_000, "7d": 7 * 86_400_000};
const SINCE_LABELS = [["", "any time"], ["15m", "last 15 minutes"], ["1h", "last hour"],
  ["24h", "last 24 hours"], ["7d", "last 7 days"], ["range", "between…"]];
const FIELDS = ["workflow", "status", "since", "after", "before", "correlation", "key", "order"];

function readFilters(params) {
  const f = {};
  for (const name of FIELDS) f[name] = (params.get(name) || "").trim();
  if (f.after || f.before) f.since = "range";
  const limit = Number.parseInt(params.get("limit") || "", 10);
  f.limit = Number.isFinite(limit) ? Math.min(1000, Math.max(1, limit)) : null;  // #/runs?limit=N: the page size
  return f;
}

/** Correlation as the API takes it: JSON text; text that is not JSON is a JSON string. */
function correlationJson(text) {
  try { return JSON.stringify(JSON.parse(text)); } catch { return JSON.stringify(text); }
}

function queryOf(f) {
  const q = {limit: f.limit || PAGE, workflow: f.workflow, status: f.status, idempotency_key: f.key,
    order: f.order === "asc" ? "asc" : undefined};
  if (SINCE[f.since]) q.created_after = Date.now() - SINCE[f.since];
  if (f.since === "range") {
    const after = toMs(f.after), before = toMs(f.before);
    if (Number.isFinite(after)) q.created_after = after;
    if (Number.isFinite(before)) q.created_before = before;
  }
  if (f.correlation) q.correlation = correlationJson(f.correlation);
  return q;
}

function option(value, label, selected) {
  return h("option", {value, selected: selected === value}, label);
}

function buildForm(f, names) {
  const workflow = h("input", {name: "workflow", value: f.workflow, list: "workflow-names",
    placeholder: "any workflow", autocomplete: "off", spellcheck: "false"});
  const datalist = h("datalist", {id: "workflow-names"}, names.map((n) => h("option", {value: n})));
  const status = h("select", {name: "status"}, option("", "any status", f.status),
    STATUSES.map((s) => option(s, s.replace("_", " "), f.status)));
  const since = h("select", {name: "since"}, SINCE_LABELS.map(([v, l]) => option(v, l, f.since)));
  const after = h("input", {type: "datetime-local", name: "after", value: f.after, "aria-label": "created after"});
  const before = h("input", {type: "datetime-local", name: "before", value: f.before, "aria-label": "created before"});
  const range = h("span", {class: "range"}, after, h("span", {class: "muted"}, "to"), before);
  range.hidden = f.since !== "range";
  since.addEventListener("change", () => {
    range.hidden = since.value !== "range";
    if (since.value === "range" && !after.value) after.value = localInput(Date.now() - 3_600_000);
  });
  const correlation = h("input", {name: "correlation", value: f.correlation, placeholder: '{"ticket": 42}',
    autocomplete: "off", spellcheck: "false"});
  const key = h("input", {name: "key", value: f.key, placeholder: "idempotency key",
    autocomplete: "off", spellcheck: "false"});
  const order = h("select", {name: "order"}, option("", "newest first", f.order), option("asc", "oldest first", f.order));
  const field = (label, ...controls) => h("label", {class: "field"}, h("span", null, label), ...controls);
  const form = h("form", {class: "filters", onsubmit: (ev) => {
    ev.preventDefault();
    const data = new FormData(form);
    const next = new URLSearchParams();
    for (const name of FIELDS) {
      const v = String(data.get(name) || "").trim();
      if (!v || (name === "since" && v === "range")) continue;
      if ((name === "after" || name === "before") && data.get("since") !== "range") continue;
      next.set(name, v);
    }
    if (f.limit) next.set("limit", String(f.limit));
    const text = next.toString();
    location.hash = "#/runs" + (text ? "?" + text : "");
  }},
  field("Workflow", workflow, datalist), field("Status", status), field("Created", since, range),
  field("Correlation", correlation), field("Idempotency key", key), field("Order", order),
  h("div", {class: "actions"},
    h("button", {type: "submit", class: "primary"}, "Apply"),
    h("a", {href: "#/runs", class: "button"}, "Clear")));
  for (const select of [status, order]) select.addEventListener("change", () => form.requestSubmit());
  return form;
}

function counts(stats, f) {
  const by = stats.runs_by_status || {};
  const base = {};
  for (const name of FIELDS) if (f[name] && name !== "status") base[name] = f[name];
  if (f.limit) base.limit = f.limit;
  const chips = STATUSES.map((s) => link(["runs"], {...base, status: f.status === s ? "" : s},
    h("span", {class: `chip s-${s}${f.status === s ? " on" : ""}`, title: `show only ${s} runs`},
      h("span", {class: "dot"}), s.replace("_", " "), h("b", null, num(by[s] || 0)))));
  const w = stats.workers || {};
  return [h("div", {class: "chips", "aria-label": "runs by status"}, chips),
    h("div", {class: "muted small"},
      link(["workers"], null, `${num(w.connected)} of ${num(w.registered)} workers connected`),
      ` · ${num(stats.live_leases)} live leases`)];
}

function sortRows(rows, order) {
  const sign = order === "asc" ? 1 : -1;
  return rows.sort((a, b) => sign * ((toMs(a.created_at) - toMs(b.created_at)) || (a.run_id < b.run_id ? -1 : a.run_id > b.run_id ? 1 : 0)));
}

function rowOf(r, now) {
  const id = h("div", null, link(["runs", r.run_id], null, h("span", {class: "mono"}, r.run_id)));
  if (r.parent_run_id) {
    id.append(h("div", {class: "small muted"}, "child of ",
      link(["runs", r.parent_run_id], null, h("span", {class: "mono"}, r.parent_run_id))));
  }
  return h("tr", {dataset: {run: r.run_id}},
    h("td", null, id),
    h("td", null, link(["runs"], {workflow: r.workflow}, r.workflow)),
    h("td", {class: "mono small"}, r.definition_version ?? "—"),
    h("td", null, badge(r.status)),
    h("td", {class: "mono small wrap"}, r.idempotency_key ?? "—"),
    h("td", {title: time(r.created_at)}, time(r.created_at)),
    h("td", {class: "muted", title: time(r.updated_at)}, ago(r.updated_at, now)));
}

export function mount(view, params, ctx) {
  const f = readFilters(params);
  const state = {rows: [], cursor: null, extra: false, names: [], seen: ""};
  const countsEl = h("div", {class: "counts"});
  const formSlot = h("div");
  const errorEl = h("p", {class: "error", role: "alert", hidden: true});
  const tableSlot = h("div");
  const more = h("button", {type: "button", class: "more", hidden: true}, "More");
  const shown = h("span", {class: "muted small"});
  fill(view,
    h("div", {class: "page-head"}, h("h1", null, "Runs"), countsEl),
    formSlot, errorEl,
    h("section", {class: "card flush"}, tableSlot, h("div", {class: "card-foot"}, shown, more)));
  fill(formSlot, buildForm(f, []));

  api("/definitions").then((d) => {
    if (!ctx.isCurrent()) return;
    const names = [...new Set((d.definitions || []).map((x) => x.name))].sort();
    const list = formSlot.querySelector("datalist");
    if (list) fill(list, names.map((n) => h("option", {value: n})));
  }).catch(() => { /* the list is a convenience */ });

  function showError(err) {
    errorEl.hidden = false;
    errorEl.textContent = err instanceof ApiError && err.field
      ? `${err.field}: ${err.message}` : (err && err.message) || String(err);
  }

  function render() {
    const now = Date.now();
    const rows = state.rows.map((r) => rowOf(r, now));
    fill(tableSlot, table(["Run", "Workflow", "Version", "Status", "Idempotency key", "Created", "Updated"], rows,
      {empty: "No run matches these filters.", cls: ["", "", "", "", "", "nowrap", "nowrap"]}));
    shown.textContent = `${num(state.rows.length)} run${state.rows.length === 1 ? "" : "s"} shown` +
      (state.cursor ? "; more follow" : "");
    more.hidden = !state.cursor;
  }

  more.addEventListener("click", async () => {
    if (!state.cursor) return;
    more.disabled = true;
    try {
      const page = await api("/runs", {query: {...queryOf(f), cursor: state.cursor}});
      if (!ctx.isCurrent()) return;
      const known = new Set(state.rows.map((r) => r.run_id));
      state.rows.push(...page.runs.filter((r) => !known.has(r.run_id)));
      state.cursor = page.next_cursor;
      state.extra = true;
      render();
    } catch (err) {
      if (!ctx.failed(err)) showError(err);
    } finally {
      more.disabled = false;
    }
  });

  async function refresh() {
    let stats, page;
    try {
      [stats, page] = await Promise.all([api("/stats"), api("/runs", {query: queryOf(f)})]);
    } catch (err) {
      if (err instanceof ApiError && err.status === 400) { showError(err); return; }
      throw err;
    }
    if (!ctx.isCurrent()) return;
    errorEl.hidden = true;
    fill(countsEl, counts(stats, f));
    if (!state.extra) {
      state.rows = page.runs;
      state.cursor = page.next_cursor;
    } else {
      const byId = new Map(state.rows.map((r) => [r.run_id, r]));
      for (const r of page.runs) byId.set(r.run_id, r);
      state.rows = sortRows([...byId.values()], f.order);
    }
    render();
  }

  return {refresh, unmount() {}};
}
