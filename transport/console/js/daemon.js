// Daemon: what the daemon does besides runs. OpenTelemetry export (on or off,
// spans exported and failed, writes queued and dropped), retention and the
// data directory's size, the audit log, and the run counts.
//
// GET /v1/api/daemon (read scope) answers what /metrics shows of these: a
// console key must not need /metrics, and the page must not parse its text.

import {api} from "./api.js";
import {h, fill, link, facts, section} from "./dom.js";
import {duration, num, STATUSES} from "./format.js";

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

export function mount(view, params, ctx) {
  const slot = h("div");
  fill(view, h("div", {class: "page-head"}, h("h1", null, "Daemon")), slot);
  let sig = "";

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
