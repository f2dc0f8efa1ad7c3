// Schedules: every schedule (GET /v1/api/schedules), its cron and zone, the
// next fire, whether it is paused, its counts, and the last runs it started;
// for a key that may act (admin, or no keys on loopback: the rule of the
// actors page's kill button) pause, resume, delete and a create form.
//
// A schedule's runs carry the correlation {"schedule_id": ...}
// (docs/schedules.md), so its last runs are one GET /v1/api/runs each. They
// are read again only when the schedule started a new run or one of them was
// not over yet: a quiet schedule costs its page nothing per poll.

import {api, ApiError, refusal} from "./api.js";
import {h, fill, link, badge, table, statusBanner} from "./dom.js";
import {ago, time, toMs, num, duration, TERMINAL} from "./format.js";

const PAGE = 1000;
const LAST_RUNS = 3;
const MAX_WITH_RUNS = 50;  // schedules whose last runs are read (the first ones shown)
const ARM_MS = 5000;
const OVERLAPS = [["skip", "skip"], ["buffer_one", "buffer one"], ["allow", "allow"]];

function browserZone() {
  try { return Intl.DateTimeFormat().resolvedOptions().timeZone || "UTC"; } catch { return "UTC"; }
}

function inFuture(value, now) {
  const ms = toMs(value);
  if (!Number.isFinite(ms)) return "";
  return ms >= now ? `in ${duration(ms - now)}` : ago(ms, now);
}

export function mount(view, params, ctx) {
  const admin = ctx.session.role === "admin";
  const state = {list: null, cursor: null, runs: new Map(), armed: null, armedAt: 0, sig: "", names: []};
  const note = h("span", {class: "note"});
  const {el: banner, say} = statusBanner();
  const formSlot = h("div");
  const slot = h("div");
  fill(view, h("div", {class: "page-head"}, h("h1", null, "Schedules"), note),
    h("p", {class: "muted"}, "Each schedule starts a run of its workflow at every time its cron expression names, in its time zone. ",
      admin ? "Pausing stops the fires until resumed; resuming does not catch up the paused time." : "A read key sees no actions."),
    banner, formSlot, h("section", {class: "card flush"}, slot));


  function refused(what, err) {
    if (!ctx.failed(err)) say("bad", ...refusal(what, err));
  }

  // ------------------------------------------------------------------ create

  function createForm() {
    const workflow = h("input", {name: "workflow", list: "schedule-workflows", required: true,
      placeholder: "workflow", autocomplete: "off", spellcheck: "false"});
    const names = h("datalist", {id: "schedule-workflows"}, state.names.map((n) => h("option", {value: n})));
    const version = h("input", {name: "version", placeholder: "latest", autocomplete: "off", spellcheck: "false"});
    const cron = h("input", {name: "cron", required: true, placeholder: "0 2 * * *", autocomplete: "off", spellcheck: "false"});
    const zone = h("input", {name: "timezone", value: browserZone(), autocomplete: "off", spellcheck: "false"});
    const overlap = h("select", {name: "overlap"}, OVERLAPS.map(([v, l]) => h("option", {value: v}, l)));
    const catchup = h("input", {name: "catchup", placeholder: "0", autocomplete: "off", spellcheck: "false",
      title: "After downtime, fires missed less than this long ago are started: ms, or 30s, 15m, 6h, 1d"});
    const input = h("input", {name: "input", placeholder: '{"scope": "all"}', autocomplete: "off", spellcheck: "false"});
    const error = h("p", {class: "error", role: "alert", hidden: true});
    const field = (label, ...controls) => h("label", {class: "field"}, h("span", null, label), ...controls);
    const submit = h("button", {type: "submit", class: "primary"}, "Create");
    const form = h("form", {class: "filters schedule-form", onsubmit: async (ev) => {
      ev.preventDefault();
      error.hidden = true;
      const body = {workflow: workflow.value.trim(), cron: cron.value.trim(),
        timezone: zone.value.trim() || "UTC", overlap: overlap.value};
      if (version.value.trim()) body.version = version.value.trim();
      const within = catchup.value.trim();  // ms, or a duration the daemon parses ("6h")
      if (within) body.catchup_window_ms = /^\d+$/.test(within) ? Number(within) : within;
      if (input.value.trim()) {
        try { body.input = JSON.parse(input.value); } catch {
          error.hidden = false;
          error.textContent = "input: not JSON (a string needs its quotes)";
          return;
        }
      }
      submit.disabled = true;
      try {
        const made = await api("/schedules", {method: "POST", body});
        say("ok", "Created ", h("span", {class: "mono"}, made.schedule_id), ` (${made.workflow}, '${made.cron}' ${made.timezone})`,
          made.next_fire_at ? `: next fire ${time(made.next_fire_at)}` : "", ".");
        form.reset();
        zone.value = body.timezone;
        state.sig = "";
        await refresh().catch(() => {});
      } catch (err) {
        if (ctx.failed(err)) return;
        error.hidden = false;
        error.textContent = err instanceof ApiError && err.field ? `${err.field}: ${err.message}` : (err && err.message) || String(err);
      } finally {
        submit.disabled = false;
      }
    }},
    field("Workflow", workflow, names), field("Version", version), field("Cron", cron), field("Time zone", zone),
    field("Overlap", overlap), field("Catch-up window", catchup), field("Input (JSON)", input),
    h("div", {class: "actions"}, submit), error);
    return h("details", {class: "card create", open: params.get("create") === "1"},
      h("summary", null, h("h2", null, "New schedule")), form);
  }

  if (admin) {
    fill(formSlot, createForm());
    api("/definitions").then((d) => {
      if (!ctx.isCurrent()) return;
      state.names = [...new Set((d.definitions || []).map((x) => x.name))].sort();
      const list = formSlot.querySelector("datalist");
      if (list) fill(list, state.names.map((n) => h("option", {value: n})));
    }).catch(() => { /* the list is a convenience */ });
  }

  // ------------------------------------------------------------------ actions

  async function act(s, action, button) {
    button.disabled = true;
    try {
      if (action === "delete") {
        await api(`/schedules/${encodeURIComponent(s.schedule_id)}`, {method: "DELETE"});
        say("ok", "Deleted ", h("span", {class: "mono"}, s.schedule_id), "; the runs it started stay.");
      } else {
        const answer = await api(`/schedules/${encodeURIComponent(s.schedule_id)}/${action}`, {method: "POST", body: {}});
        say("ok", action === "pause" ? "Paused " : "Resumed ", h("span", {class: "mono"}, answer.schedule_id),
          answer.next_fire_at ? `: next fire ${time(answer.next_fire_at)}.` : ".");
      }
    } catch (err) {
      refused(action[0].toUpperCase() + action.slice(1), err);
    } finally {
      state.armed = null;
      state.sig = "";
      await refresh().catch(() => {});
    }
  }

  function deleteButton(s) {
    const id = s.schedule_id;
    const armed = state.armed === id && Date.now() - state.armedAt < ARM_MS;
    const button = h("button", {type: "button", class: armed ? "danger armed" : "danger",
      "aria-label": armed ? `confirm delete ${id}` : `delete ${id}`}, armed ? "Confirm delete" : "Delete");
    button.addEventListener("click", () => {
      if (state.armed === id && Date.now() - state.armedAt < ARM_MS) { act(s, "delete", button); return; }
      state.armed = id;
      state.armedAt = Date.now();
      state.sig = "";
      render();
      setTimeout(() => { if (state.armed === id && Date.now() - state.armedAt >= ARM_MS) { state.armed = null; state.sig = ""; render(); } }, ARM_MS + 50);
    });
    return button;
  }

  function actions(s) {
    if (!admin) return null;
    const toggle = h("button", {type: "button", class: "small-button", dataset: {action: s.paused ? "resume" : "pause"}},
      s.paused ? "Resume" : "Pause");
    toggle.addEventListener("click", () => act(s, s.paused ? "resume" : "pause", toggle));
    return h("div", {class: "row-actions"}, toggle, deleteButton(s));
  }

  // ------------------------------------------------------------------ the table

  function lastRuns(s) {
    const known = state.runs.get(s.schedule_id);
    const runs = known ? known.runs : [];
    if (!runs.length) {
      return s.last_run_id ? link(["runs", s.last_run_id], null, h("span", {class: "mono small"}, s.last_run_id))
        : h("span", {class: "muted"}, "none yet");
    }
    const list = h("ul", {class: "plain sched-runs"}, runs.map((r) => h("li", {dataset: {run: r.run_id}},
      link(["runs", r.run_id], null, h("span", {class: "mono small"}, r.run_id)), " ", badge(r.status))));
    const started = (s.fires && s.fires.started) || 0;
    if (started > runs.length) {
      list.append(h("li", null, link(["runs"], {correlation: JSON.stringify({schedule_id: s.schedule_id})},
        h("span", {class: "small"}, `all ${num(started)} runs →`))));
    }
    return list;
  }

  function render() {
    if (!state.list) return;
    const now = Date.now();
    const sig = JSON.stringify([state.list, [...state.runs.entries()].map(([k, v]) => [k, v.runs]), state.armed,
      Math.floor(now / 1000)]);
    if (sig === state.sig) return;
    state.sig = sig;
    const paused = state.list.filter((s) => s.paused).length;
    note.textContent = `${num(state.list.length)} schedule${state.list.length === 1 ? "" : "s"} · ${num(paused)} paused` +
      (state.cursor ? " · more exist: stepd schedule list shows them all" : "");
    const rows = state.list.map((s) => {
      const fires = s.fires || {};
      return h("tr", {dataset: {schedule: s.schedule_id}, class: s.paused ? "faded" : ""},
        h("td", null, h("div", {class: "mono small"}, s.schedule_id),
          h("div", {class: "muted small", title: time(s.created_at)}, s.created_at ? `created ${ago(s.created_at, now)}` : "")),
        h("td", null, link(["runs"], {workflow: s.workflow}, s.workflow),
          h("div", {class: "mono small muted"}, s.version ?? "latest version")),
        h("td", null, h("div", {class: "mono cron"}, s.cron), h("div", {class: "small muted"}, s.timezone)),
        h("td", {class: "small"}, String(s.overlap).replace("_", " "),
          s.catchup_window_ms ? h("div", {class: "muted"}, `catch up ${duration(s.catchup_window_ms)}`) : null),
        h("td", {class: "nowrap", title: time(s.next_fire_at)}, s.paused ? h("span", {class: "muted"}, "—")
          : [h("div", null, time(s.next_fire_at)), h("div", {class: "small muted"}, inFuture(s.next_fire_at, now))],
        s.buffered_fire_at ? h("div", {class: "small"}, `held: ${time(s.buffered_fire_at)}`) : null),
        h("td", null, h("span", {class: `badge ${s.paused ? "s-cancelled" : "s-running"}`}, s.paused ? "paused" : "active"),
          s.last_error ? h("div", {class: "small err-text wrap", title: s.last_error}, s.last_error) : null),
        h("td", {class: "num small"}, h("div", null, `${num(fires.started ?? 0)} started`),
          fires.skipped ? h("div", {class: "muted"}, `${num(fires.skipped)} skipped`) : null,
          fires.dropped ? h("div", {class: "muted"}, `${num(fires.dropped)} dropped`) : null),
        h("td", null, lastRuns(s)),
        h("td", {class: "act"}, actions(s)));
    });
    fill(slot, table(["Schedule", "Workflow", "Cron", "Overlap", "Next fire", "State", "Fires", "Last runs", ""], rows,
      {empty: admin ? "No schedule yet: create one above, or with stepd schedule create." : "No schedule yet.",
        cls: ["", "", "", "", "", "", "num", "", "act"]}));
  }

  async function runsOf(s) {
    const known = state.runs.get(s.schedule_id);
    const fresh = known && known.last === s.last_run_id && known.runs.every((r) => TERMINAL.has(r.status));
    if (fresh || !s.last_run_id) return;
    const page = await api("/runs", {query: {correlation: JSON.stringify({schedule_id: s.schedule_id}), limit: LAST_RUNS}});
    state.runs.set(s.schedule_id, {last: s.last_run_id, runs: page.runs || []});
  }

  async function refresh() {
    const answer = await api("/schedules", {query: {limit: PAGE}});
    if (!ctx.isCurrent()) return;
    const list = answer.schedules || [];
    const ids = new Set(list.map((s) => s.schedule_id));
    for (const id of [...state.runs.keys()]) if (!ids.has(id)) state.runs.delete(id);
    await Promise.all(list.slice(0, MAX_WITH_RUNS).map(runsOf));
    if (!ctx.isCurrent()) return;
    state.list = list;
    state.cursor = answer.next_cursor;
    render();
  }

  return {refresh, unmount() {}};
}
