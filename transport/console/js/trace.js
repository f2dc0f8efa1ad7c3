// A run's trace as a waterfall: step attempts from the journal, and under
// each attempt the body spans its worker reported.
//
// The journal gives every attempt's times: step_offered (the lease is
// handed out), step_started (the body runs), then step_completed or
// step_failed (or step_recovered / step_unservable) with the same lease_id.
// Waits, sleeps, for_each and start_workflows steps are rows of their own
// (step_scheduled to the step_completed without a lease), with a for_each's
// item attempts beneath. Spans come from the export (`spans`: start_ms,
// end_ms, name, parent_span_id, usage, attributes), nested by parent id
// within their lease; a span whose parent is not among them (the lease's own
// span) hangs under the attempt.
//
// Local steps (docs/affinity.md "Local steps") are journaled under their
// parent's lease_id, marked execution_mode "local": each is a row of its own
// under the parent attempt (never the parent's start, end or usage), with
// its body's spans beneath it. Its entries are all stamped with the commit's
// time, so its bar ends there and starts its measured duration (ended_ms,
// the worker's clock) earlier.

import {h, fill} from "./dom.js";
import {duration, num, usd} from "./format.js";

const MAX_ROWS = 1500;

/** The trace's rows and time range; pure (journal, spans) -> model. */
export function buildTrace(journal, spans, now, terminal) {
  const top = [];
  const attempts = new Map();
  const groups = new Map();
  const first = journal.length ? journal[0].at : now;
  let last = first;
  const attemptOf = (e) => (e.lease_id ? attempts.get(e.lease_id) : undefined);
  const locals = new Map();
  const local = (e) => {
    const key = `${e.lease_id}/${e.step_id}`;
    if (e.type === "step_scheduled") {
      const parent = attemptOf(e);
      const row = {kind: "attempt", local: true, step_id: e.step_id, item_index: null, attempt: null,
        worker_name: parent ? parent.worker_name : null, worker_id: e.worker_id, lease_id: e.lease_id,
        offered: e.at, started: e.at, end: null, outcome: "running", error: null, usage: null, marks: [],
        locals: [], key: `local/${key}/${e.seq}`};
      locals.set(key, row);
      if (parent) parent.locals.push(row); else top.push(row);
      return;
    }
    const row = locals.get(key);
    if (!row) return;
    if (typeof e.attempt === "number") row.attempt = e.attempt;
    if (e.type === "step_completed" || e.type === "step_failed") {
      row.end = e.at;
      if (typeof e.ended_ms === "number" && e.ended_ms >= 0) row.offered = row.started = e.at - e.ended_ms;
      row.outcome = e.type === "step_completed" ? "completed" : "failed";
      row.error = e.type === "step_failed" ? {class: e.error_class, message: e.message} : null;
      if (e.usage) row.usage = e.usage;
    }
  };

  for (const e of journal) {
    if (typeof e.at === "number") last = Math.max(last, e.at);
    if (e.execution_mode === "local") { local(e); continue; }
    switch (e.type) {
      case "step_scheduled": {
        if (e.kind && e.kind !== "task") {
          const row = {kind: "step", label: String(e.step_id), sub: String(e.kind), start: e.at, end: null,
            outcome: "waiting", children: [], marks: [], key: `step/${e.step_id}/${e.visit ?? ""}`};
          groups.set(e.step_id, row);
          top.push(row);
        } else {
          groups.delete(e.step_id);
        }
        break;
      }
      case "step_offered": {
        const parent = groups.get(e.step_id);
        const row = {kind: "attempt", step_id: e.step_id, item_index: e.item_index, attempt: e.attempt,
          worker_name: e.worker_name, worker_id: e.worker_id, lease_id: e.lease_id, offered: e.at,
          started: null, end: null, outcome: "offered", error: null, usage: null, marks: [],
          spans: [], locals: [], key: `lease/${e.lease_id}`};
        if (e.lease_id) attempts.set(e.lease_id, row);
        (parent && parent.kind === "step" ? parent.children : top).push(row);
        break;
      }
      case "step_started": {
        const a = attemptOf(e);
        if (a) { a.started = e.at; a.outcome = "running"; }
        break;
      }
      case "step_completed": {
        const a = attemptOf(e);
        if (a) { a.end = e.at; a.outcome = "completed"; a.usage = e.usage || null; }
        else if (groups.has(e.step_id)) { const g = groups.get(e.step_id); g.end = e.at; g.outcome = "completed"; }
        break;
      }
      case "step_failed": {
        const a = attemptOf(e);
        const error = {class: e.error_class, message: e.message};
        if (a) { a.end = e.at; a.outcome = "failed"; a.error = error; }
        else if (groups.has(e.step_id)) { const g = groups.get(e.step_id); g.end = e.at; g.outcome = "failed"; g.error = error; }
        else {
          top.push({kind: "step", label: String(e.step_id), sub: "failed", start: e.at, end: e.at,
            outcome: "failed", error, children: [], marks: [], key: `fail/${e.seq}`});
        }
        break;
      }
      case "step_orphaned": {
        const a = attemptOf(e);
        if (a) { a.marks.push({at: e.at, what: "orphaned"}); a.outcome = "orphaned"; }
        break;
      }
      case "step_revived": {
        const a = attemptOf(e);
        if (a) { a.marks.push({at: e.at, what: "revived"}); a.outcome = a.started ? "running" : "offered"; }
        break;
      }
      case "step_recovered": {
        const a = attemptOf(e);
        if (a) { a.end = e.at; a.outcome = e.released ? "released" : "recovered"; }
        break;
      }
      case "step_unservable": {
        const a = attemptOf(e);
        if (a) { a.end = e.at; a.outcome = "unservable"; a.error = {class: "unservable", message: e.message}; }
        break;
      }
      case "signal_received":
      case "timer_fired":
      case "child_started": {
        const g = groups.get(e.step_id);
        if (g) g.marks.push({at: e.at, what: e.type === "signal_received" ? `signal ${e.name}` : e.type.replace("_", " ")});
        break;
      }
      default:
        break;
    }
  }

  // By lease and step: a local step's spans share its parent's lease.
  const byLease = new Map();
  for (const s of spans || []) {
    if (!s || typeof s.start_ms !== "number" || typeof s.end_ms !== "number") continue;
    const k = `${s.lease_id}/${s.step_id}`;
    if (!byLease.has(k)) byLease.set(k, []);
    byLease.get(k).push(s);
  }
  // Spans carry the workers' clocks: they may start before the journal's first event.
  let start = first;
  let end = terminal ? last : Math.max(last, now);
  for (const list of byLease.values()) {
    for (const s of list) { start = Math.min(start, s.start_ms); end = Math.max(end, s.end_ms); }
  }

  const rows = [];
  const pushSpans = (attempt, depth) => {
    const list = byLease.get(`${attempt.lease_id}/${attempt.step_id}`) || [];
    const ids = new Set(list.map((s) => s.span_id));
    const kids = new Map();
    const roots = [];
    for (const s of list) {
      if (s.parent_span_id && ids.has(s.parent_span_id) && s.parent_span_id !== s.span_id) {
        if (!kids.has(s.parent_span_id)) kids.set(s.parent_span_id, []);
        kids.get(s.parent_span_id).push(s);
      } else roots.push(s);
    }
    const seen = new Set();
    const walk = (s, d) => {
      if (seen.has(s.span_id) || rows.length >= MAX_ROWS) return;  // a cycle in worker data: shown once
      seen.add(s.span_id);
      rows.push({kind: "span", depth: d, span: s, start: s.start_ms, end: s.end_ms,
        key: `span/${attempt.lease_id}/${attempt.step_id}/${s.span_id}`});
      for (const c of (kids.get(s.span_id) || []).sort((a, b) => a.start_ms - b.start_ms)) walk(c, d + 1);
    };
    for (const r of roots.sort((a, b) => a.start_ms - b.start_ms)) walk(r, depth);
  };
  const pushAttempt = (a, depth) => {
    if (rows.length >= MAX_ROWS) return;
    rows.push({...a, depth, start: a.offered});
    pushSpans(a, depth + 1);
    for (const l of a.locals || []) pushAttempt(l, depth + 1);
  };
  for (const r of top) {
    if (rows.length >= MAX_ROWS) break;
    if (r.kind === "attempt") pushAttempt(r, 0);
    else {
      rows.push({...r, depth: 0});
      for (const c of r.children) pushAttempt(c, 1);
    }
  }
  const total = journal.length + (spans ? spans.length : 0);
  return {start, end: Math.max(end, start + 1), rows, cut: rows.length >= MAX_ROWS, total, now, terminal};
}

function niceStep(total) {
  const raw = total / 5;
  const pow = 10 ** Math.floor(Math.log10(raw));
  for (const m of [1, 2, 5, 10]) if (raw <= m * pow) return m * pow;
  return 10 * pow;
}

function pct(x, model) {
  return `${(((x - model.start) / (model.end - model.start)) * 100).toFixed(3)}%`;
}

function bar(model, from, to, cls, title) {
  const b = h("div", {class: `bar ${cls}`, title});
  b.style.left = pct(from, model);
  b.style.width = `max(2px, ${(((to - from) / (model.end - model.start)) * 100).toFixed(3)}%)`;
  return b;
}

function tokens(usage) {
  if (!usage) return null;
  const inT = usage.input_tokens || 0, outT = usage.output_tokens || 0;
  if (!inT && !outT) return null;
  return `${num(inT)} in · ${num(outT)} out`;
}

function attemptLabel(r) {
  const item = r.item_index !== null && r.item_index !== undefined ? `[${r.item_index}]` : "";
  return [h("span", {class: "name"}, `${r.step_id}${item}`),
    h("span", {class: "tag"}, `#${r.attempt ?? "?"}`),
    r.local ? h("span", {class: "tag", title: "ran in the parent's worker, no lease of its own"}, "local") : null,
    h("div", {class: "sub", title: r.worker_id || ""}, r.worker_name || r.worker_id || "")];
}

function detailOf(r) {
  if (r.kind === "span") {
    const s = r.span;
    const lines = [["span", s.span_id], ["parent", s.parent_span_id ?? "—"], ["duration", duration(s.end_ms - s.start_ms)]];
    if (s.usage) lines.push(["usage", JSON.stringify(s.usage)]);
    return h("div", {class: "wf-detail"},
      h("dl", {class: "facts tight"}, lines.map(([k, v]) => [h("dt", null, k), h("dd", {class: "mono"}, v)])),
      h("pre", {class: "json"}, JSON.stringify(s.attributes ?? {}, null, 2)));
  }
  const lines = [];
  if (r.lease_id) lines.push(["lease", r.lease_id]);
  if (r.worker_id) lines.push(["worker", `${r.worker_name ?? ""} (${r.worker_id})`]);
  if (r.started) lines.push(["waited", duration(r.started - r.offered)]);
  for (const m of r.marks || []) lines.push([m.what, `+${duration(m.at - (r.offered ?? r.start))}`]);
  if (r.error) lines.push(["error", `${r.error.class ?? ""}: ${r.error.message ?? ""}`]);
  if (r.usage) lines.push(["usage", JSON.stringify(r.usage)]);
  return h("div", {class: "wf-detail"},
    h("dl", {class: "facts tight"}, lines.map(([k, v]) => [h("dt", null, k), h("dd", {class: "mono"}, v)])));
}

/** The waterfall's DOM for a model; `open` is the set of row keys whose details show. */
export function renderTrace(model, open) {
  const step = niceStep(model.end - model.start);
  const gridSize = `${((step / (model.end - model.start)) * 100).toFixed(4)}% 100%`;
  const axis = h("div", {class: "wf-track axis"});
  for (let t = 0; model.start + t <= model.end; t += step) {
    const tick = h("span", {class: "tick"}, duration(t));
    tick.style.left = pct(model.start + t, model);
    axis.append(tick);
  }
  const head = h("div", {class: "wf-row wf-head"}, h("div", {class: "wf-label"}, "step · attempt · span"), axis,
    h("div", {class: "wf-meta"}, "duration · tokens · cost"));
  const body = h("div", {class: "wf-body"});
  const endOf = (r) => r.end ?? (model.terminal ? model.end : model.now);

  for (const r of model.rows) {
    const track = h("div", {class: "wf-track"});
    track.style.backgroundSize = gridSize;
    const meta = h("div", {class: "wf-meta"});
    let label;
    let cls = "wf-row";
    if (r.kind === "attempt") {
      cls += ` attempt o-${r.outcome}`;
      label = attemptLabel(r);
      const started = r.started ?? null;
      const stop = endOf(r);
      if (started !== null) {
        if (started > r.offered) track.append(bar(model, r.offered, started, "queued", `waited ${duration(started - r.offered)} for the worker`));
        track.append(bar(model, started, stop, `run o-${r.outcome}`, `${r.outcome} · ${duration(stop - started)}`));
      } else {
        track.append(bar(model, r.offered, stop, `queued o-${r.outcome}`, `${r.outcome} · not started`));
      }
      for (const m of r.marks) {
        const mark = h("div", {class: "mark", title: m.what});
        mark.style.left = pct(m.at, model);
        track.append(mark);
      }
      meta.append(h("span", null, started !== null ? duration(stop - started) : r.outcome));
      const t = tokens(r.usage);
      if (t) meta.append(h("span", {class: "tok"}, t));
      if (r.usage && r.usage.cost_usd) meta.append(h("span", {class: "cost"}, usd(r.usage.cost_usd)));
      if (r.error) meta.append(h("span", {class: "err", title: r.error.message ?? ""}, r.error.class ?? "error"));
    } else if (r.kind === "span") {
      cls += " span";
      const s = r.span;
      label = [h("span", {class: "name"}, String(s.name))];
      const attrs = s.attributes && typeof s.attributes === "object" ? Object.entries(s.attributes) : [];
      if (attrs.length) {
        label.push(h("div", {class: "sub"}, attrs.slice(0, 3).map(([k, v]) => `${k}=${typeof v === "string" ? v : JSON.stringify(v)}`).join(" ")));
      }
      track.append(bar(model, s.start_ms, s.end_ms, "span", `${s.name} · ${duration(s.end_ms - s.start_ms)}`));
      meta.append(h("span", null, duration(s.end_ms - s.start_ms)));
      const t = tokens(s.usage);
      if (t) meta.append(h("span", {class: "tok"}, t));
      if (s.usage && s.usage.cost_usd) meta.append(h("span", {class: "cost"}, usd(s.usage.cost_usd)));
    } else {
      cls += ` step o-${r.outcome}`;
      label = [h("span", {class: "name"}, r.label), h("span", {class: "tag"}, r.sub),
        r.children && r.children.length ? h("div", {class: "sub"}, `${r.children.length} attempt${r.children.length === 1 ? "" : "s"}`) : null];
      const stop = endOf(r);
      track.append(bar(model, r.start, stop, `group o-${r.outcome}`, `${r.sub} · ${duration(stop - r.start)}`));
      for (const m of r.marks) {
        const mark = h("div", {class: "mark", title: m.what});
        mark.style.left = pct(m.at, model);
        track.append(mark);
      }
      meta.append(h("span", null, duration(stop - r.start)));
      if (r.error) meta.append(h("span", {class: "err", title: r.error.message ?? ""}, r.error.class ?? "error"));
    }
    const labelEl = h("div", {class: "wf-label"}, label);
    labelEl.style.paddingLeft = `${8 + r.depth * 16}px`;
    const row = h("div", {class: cls, role: "button", tabindex: "0", "aria-expanded": open.has(r.key) ? "true" : "false",
      dataset: {kind: r.kind}}, labelEl, track, meta);
    const detail = detailOf(r);
    detail.hidden = !open.has(r.key);
    const toggle = () => {
      detail.hidden = !detail.hidden;
      row.setAttribute("aria-expanded", detail.hidden ? "false" : "true");
      if (detail.hidden) open.delete(r.key); else open.add(r.key);
    };
    row.addEventListener("click", toggle);
    row.addEventListener("keydown", (ev) => { if (ev.key === "Enter" || ev.key === " ") { ev.preventDefault(); toggle(); } });
    body.append(row, detail);
  }
  const legend = h("div", {class: "legend"},
    [["queued", "waiting for a worker"], ["o-running", "running"], ["o-completed", "completed"],
      ["o-failed", "failed"], ["o-orphaned", "orphaned / recovered"], ["span", "span"], ["group", "wait, sleep, for_each"]]
      .map(([c, t]) => h("span", null, h("i", {class: `swatch ${c}`}), t)));
  const wrap = h("div", {class: "waterfall"}, head, body);
  if (!model.rows.length) fill(body, h("p", {class: "muted pad"}, "No step has been offered yet."));
  return [legend, wrap, model.cut ? h("p", {class: "muted small"}, `Only the first ${MAX_ROWS} rows are drawn.`) : null];
}
