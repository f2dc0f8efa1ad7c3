// Workers: connected first (the API's order), what each serves, its live leases.
//
// GET /v1/api/workers does not say which definitions a worker holds;
// GET /v1/api/definitions does (`worker_ids` of each definition), so the
// page joins the two.

import {api} from "./api.js";
import {h, fill, link, table} from "./dom.js";
import {ago, time, num} from "./format.js";

const MAX_LEASES = 12;

function leasesOf(w) {
  const leases = w.leases || [];
  if (!leases.length) return h("span", {class: "muted"}, "none");
  const list = h("ul", {class: "leases"}, leases.slice(0, MAX_LEASES).map((l) => {
    const item = l.item_index !== null && l.item_index !== undefined ? `[${l.item_index}]` : "";
    return h("li", {title: l.lease_id},
      link(["runs", l.run_id], null, h("span", {class: "mono"}, l.run_id)), " ",
      h("span", {class: "mono"}, `${l.step_id}${item}`), " ",
      h("span", {class: `lease-status ${l.status === "started" ? "on" : ""}`}, String(l.status ?? "")),
      l.attempt ? h("span", {class: "muted small"}, ` #${l.attempt}`) : null);
  }));
  if (leases.length > MAX_LEASES) list.append(h("li", {class: "muted"}, `and ${num(leases.length - MAX_LEASES)} more`));
  return list;
}

export function mount(view, params, ctx) {
  const summary = h("span", {class: "note"});
  const slot = h("div");
  fill(view, h("div", {class: "page-head"}, h("h1", null, "Workers"), summary), h("section", {class: "card flush"}, slot));
  let sig = "";

  async function refresh() {
    const [w, d] = await Promise.all([api("/workers"), api("/definitions")]);
    if (!ctx.isCurrent()) return;
    const text = JSON.stringify([w, d, Math.floor(Date.now() / 10_000)]);  // "ago" moves too
    if (text === sig) return;  // nothing moved: keep the page as it is (selection, scroll)
    sig = text;
    const held = new Map();
    for (const def of d.definitions || []) {
      for (const id of def.worker_ids || []) {
        if (!held.has(id)) held.set(id, []);
        held.get(id).push(def);
      }
    }
    const workers = w.workers || [];
    const connected = workers.filter((x) => x.connected).length;
    const leases = workers.reduce((n, x) => n + (x.leases || []).length, 0);
    summary.textContent = `${num(connected)} connected of ${num(workers.length)} · ${num(leases)} live leases`;
    const rows = workers.map((x) => h("tr", {class: x.connected ? "" : "faded", dataset: {worker: x.worker_id}},
      h("td", null, h("div", {class: "strong wrap"}, String(x.name)), h("div", {class: "mono small muted"}, x.worker_id)),
      h("td", null, h("span", {class: `conn ${x.connected ? "on" : "off"}`}, x.connected ? "connected" : "gone")),
      h("td", null, h("ul", {class: "defs"}, (held.get(x.worker_id) || []).map((def) =>
        h("li", null, link(["definitions"], {name: def.name}, def.name), " ",
          h("span", {class: "mono small muted"}, def.version ?? "no version")))),
      (held.get(x.worker_id) || []).length ? null : h("span", {class: "muted"}, "—")),
      h("td", null, leasesOf(x)),
      h("td", {class: "num"}, x.concurrency === undefined ? "—" : String(x.concurrency)),
      h("td", {class: "small"}, h("div", {class: "mono wrap"}, x.build_id ?? "—"),
        h("div", {class: "muted nowrap"}, `protocol ${x.protocol_version ?? "?"}`)),
      h("td", {class: "nowrap", title: time(x.last_heartbeat_at)}, x.last_heartbeat_at ? ago(x.last_heartbeat_at) : "—"),
      h("td", {class: "nowrap muted", title: time(x.registered_at)}, x.registered_at ? ago(x.registered_at) : "—")));
    fill(slot, table(["Worker", "Connection", "Definitions", "Live leases", "Slots", "Build", "Last call", "Registered"], rows,
      {empty: "No worker has registered (or all were forgotten after --worker-expiry-ms)."}));
  }

  return {refresh, unmount() {}};
}
