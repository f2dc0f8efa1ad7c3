// Daemon: what the daemon does besides runs. OpenTelemetry export (on or off,
// spans exported and failed, writes queued and dropped), retention and the
// data directory's size, the audit log, and the run counts.
//
// GET /v1/api/daemon (read scope) answers what /metrics shows of these: a
// console key must not need /metrics, and the page must not parse its text.
// An admin key also gets Prune (POST /v1/api/runs/prune: finished runs that
// ended before a time), armed on the first click as the actors' Kill is.

import {api, refusal} from "./api.js";
import {h, fill, link, facts, section, statusBanner} from "./dom.js";
import {duration, num, toMs, localInput, STATUSES} from "./format.js";

const ARM_MS = 5000;

/** 1536 -> "1.5 KiB". */
export function bytes(n) {
  const v = Number(n);
  if (!Number.isFinite(v)) return "—";
  const units = ["bytes", "KiB", "MiB", "GiB", "TiB"];
  let i = 0, x = v;
  while (x >= 1024 && i < units.length - 1) { x /= 1024; i += 1; }
  return i === 0 ? `${num(v)} bytes` : `${x.toFixed(x < 10 ? 2 : 1)} ${units[i]}`;
}

/** A retention as people set it: "30 days", "12 hours", else a duration. */
function period(ms) {
  const day = 86_400_000, hour = 3_600_000;
  if (ms % day === 0) return `${num(ms / day)} day${ms === day ? "" : "s"}`;
  if (ms % hour === 0) return `${num(ms / hour)} hour${ms === hour ? "" : "s"}`;
  return duration(ms);
}

function tile(name, value, label, cls = "") {
  return h("div", {class: `tile ${cls}`, dataset: {what: name}}, h("b", null, value), h("span", null, label));
}

function otelCard(otel) {
  if (!otel.enabled) {
    return section("OpenTelemetry export", "off",
      h("p", {class: "muted", dataset: {otel: "off"}},
        "Spans are not exported. Start the daemon with --otlp-endpoint URL (docs/otel.md) to send runs, ",
        "step attempts and body spans to an OTLP/HTTP collector."));
  }
  return section("OpenTelemetry export", "on",
    h("div", {class: "tiles tiles5", dataset: {otel: "on"}},
      tile("exported", num(otel.exported), "spans exported", "good"),
      tile("failed", num(otel.failed), "spans failed", otel.failed ? "bad" : ""),
      tile("queued", num(otel.queued), "run writes queued"),
      tile("dropped", num(otel.dropped), "writes dropped (queue full)", otel.dropped ? "bad" : ""),
      tile("forgotten", num(otel.forgotten), "attempts forgotten", otel.forgotten ? "bad" : "")),
    h("p", {class: "muted small"}, "The same counts as stepd_otel_export{what=...} on /metrics. ",
      "Dropped writes lost their spans; the runs themselves are never affected."));
}

function storageCard(d) {
  const r = d.retention || {};
  return section("Storage and retention", null, facts([
    ["Data directory", h("span", {dataset: {what: "data_dir_bytes"}, title: `${num(d.data_dir_bytes)} bytes`}, bytes(d.data_dir_bytes))],
    ["Retention", h("span", {dataset: {what: "retention"}}, r.retention_ms
      ? `finished runs are deleted ${period(r.retention_ms)} after they ended`
      : "off: finished runs are kept until pruned (stepd run prune --before WHEN)")],
    ["Idempotency keys", r.idempotency_retention_ms ? `kept ${period(r.idempotency_retention_ms)}` : "kept with their runs"],
    ["Runs pruned", h("span", {dataset: {what: "runs_pruned"}}, `${num(d.runs_pruned)} since the daemon started`)],
  ]), h("p", {class: "muted small"}, "LMDB never shrinks its file: with retention it stops growing rather than falling (docs/storage.md \"Retention\")."));
}

function aboutCard(d, stats) {
  const by = stats.runs_by_status || {};
  const w = stats.workers || {};
  return section("Daemon", null, facts([
    ["Version", h("span", {class: "mono"}, d.version)],
    ["Audit log", d.audited ? "on: every API call is recorded" : "off"],
    ["Workers", link(["workers"], null, `${num(w.connected)} of ${num(w.registered)} connected`)],
    ["Live leases", num(stats.live_leases)],
    ["Runs", h("span", null, STATUSES.filter((s) => by[s]).map((s, i) => [i ? " · " : "",
      link(["runs"], {status: s}, `${num(by[s])} ${s.replace("_", " ")}`)]))],
  ]));
}

/** The admin's prune form: every finished run that ended before a time, with its keys. */
function pruneCard(ctx, say, after) {
  const before = h("input", {type: "datetime-local", name: "before", value: localInput(Date.now() - 30 * 86_400_000),
    "aria-label": "ended before", required: true});
  const button = h("button", {type: "submit", class: "danger", dataset: {action: "prune"}}, "Prune");
  let armed = 0;
  const disarm = () => { armed = 0; button.classList.remove("armed"); button.textContent = "Prune"; };
  const form = h("form", {class: "prune", onsubmit: async (ev) => {
    ev.preventDefault();
    const at = toMs(before.value);
    if (!Number.isFinite(at)) { say("bad", "Prune refused: before: pick a time"); return; }
    if (Date.now() - armed >= ARM_MS) {
      armed = Date.now();
      button.classList.add("armed");
      button.textContent = "Confirm prune";
      setTimeout(() => { if (Date.now() - armed >= ARM_MS) disarm(); }, ARM_MS + 50);
      return;
    }
    disarm();
    button.disabled = true;
    try {
      const answer = await api("/runs/prune", {method: "POST", body: {before: at}});
      say("ok", `Deleted ${num(answer.deleted)} finished run${answer.deleted === 1 ? "" : "s"}` +
        (answer.more ? "; more are left: prune again." : "."));
    } catch (err) {
      if (ctx.failed(err)) return;
      say("bad", ...refusal("Prune", err));
    } finally {
      button.disabled = false;
      await after();
    }
  }}, h("span", null, "Delete finished runs that ended before "), before, " ", button);
  return section("Prune", "now, besides retention", form,
    h("p", {class: "muted small"}, "Runs not yet over are never deleted. Idempotency keys taken before that time go too: a start with one of them starts a new run."));
}

export function mount(view, params, ctx) {
  const admin = ctx.session.role === "admin";
  let sig = "";
  const {el: banner, say} = statusBanner();
  const slot = h("div");
  const prune = admin ? pruneCard(ctx, say, async () => { sig = ""; await refresh().catch(() => {}); }) : null;
  fill(view, h("div", {class: "page-head"}, h("h1", null, "Daemon")), banner, slot, prune);

  async function refresh() {
    const [d, stats] = await Promise.all([api("/daemon"), api("/stats")]);
    if (!ctx.isCurrent()) return;
    const text = JSON.stringify([d, stats]);
    if (text === sig) return;
    sig = text;
    fill(slot, h("div", {class: "cols2"}, otelCard(d.otel || {enabled: false}), storageCard(d)), aboutCard(d, stats));
  }

  return {refresh, unmount() {}};
}
