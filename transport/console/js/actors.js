// Actors: the daemon's supervision tree, and for an admin key a kill button
// per actor (fault injection: POST /v1/api/actors/kill; the supervisor
// restarts the actor from storage, with the siblings its strategy restarts,
// and the answer names them).
//
// GET /v1/api/actors needs the admin scope, so a read key sees a note here
// and makes no call (a refused call would be audited every poll).

import {api, ApiError} from "./api.js";
import {h, fill, table, statusBanner} from "./dom.js";
import {duration, num} from "./format.js";

const MAX_CHILDREN = 50;
const ARM_MS = 5000;

function flatten(node, depth, rows, filter) {
  const match = !filter || node.path.includes(filter);
  const children = node.children || [];
  const kept = [];
  for (const child of children) {
    const sub = [];
    if (flatten(child, depth + 1, sub, filter)) kept.push(sub);
  }
  if (!match && !kept.length) return false;
  rows.push({node, depth, children: children.length});
  const shown = filter ? kept : kept.slice(0, MAX_CHILDREN);
  for (const sub of shown) rows.push(...sub);
  if (shown.length < kept.length) {
    rows.push({more: kept.length - shown.length, depth: depth + 1, parent: node.path});
  }
  return true;
}

export function mount(view, params, ctx) {
  const admin = ctx.session.role === "admin";
  const state = {armed: null, armedAt: 0, sig: "", tree: null, filter: params.get("path") || ""};
  const {el: banner, say} = statusBanner();
  const filter = h("input", {type: "search", placeholder: "filter by path (/runs/r_…)", value: state.filter,
    autocomplete: "off", spellcheck: "false", "aria-label": "filter actors by path"});
  const slot = h("div");
  const note = h("span", {class: "note"});
  fill(view, h("div", {class: "page-head"}, h("h1", null, "Actors"), note),
    h("p", {class: "muted"}, admin
      ? "The supervision tree. Kill an actor to inject a fault: its supervisor restarts it from storage."
      : "The supervision tree."),
    banner, h("div", {class: "toolbar"}, filter), h("section", {class: "card flush"}, slot));

  if (!admin) {
    fill(slot, h("p", {class: "pad notice"},
      "The actor tree needs an admin key: GET /v1/api/actors is an admin call. Sign in with an admin key to see it and to kill actors."));
    return {refresh: async () => {}, unmount() {}};
  }

  filter.addEventListener("input", () => { state.filter = filter.value.trim(); state.sig = ""; render(); });


  async function kill(path, button) {
    button.disabled = true;
    try {
      const answer = await api("/actors/kill", {method: "POST", body: {path}});
      const others = (answer.restarted || []).filter((p) => p !== answer.path);
      say("ok", "Killed ", h("span", {class: "mono"}, answer.path), "; its supervisor restarts it from storage",
        others.length ? [", and with it ", h("span", {class: "mono"}, others.join(", "))] : null, ".");
    } catch (err) {
      if (ctx.failed(err)) return;
      say("bad", `Kill refused: ${err instanceof ApiError ? err.message : String(err)}`);
    } finally {
      state.armed = null;
      state.sig = "";
      await refresh().catch(() => {});
    }
  }

  function killButton(path) {
    const armed = state.armed === path && Date.now() - state.armedAt < ARM_MS;
    const button = h("button", {type: "button", class: armed ? "danger armed" : "danger",
      "aria-label": armed ? `confirm kill ${path}` : `kill ${path}`, dataset: {path}},
    armed ? "Confirm kill" : "Kill");
    button.addEventListener("click", (ev) => {
      ev.stopPropagation();
      if (state.armed === path && Date.now() - state.armedAt < ARM_MS) { kill(path, button); return; }
      state.armed = path;
      state.armedAt = Date.now();
      state.sig = "";
      render();
      setTimeout(() => { if (state.armed === path && Date.now() - state.armedAt >= ARM_MS) { state.armed = null; state.sig = ""; render(); } }, ARM_MS + 50);
    });
    return button;
  }

  function render() {
    if (!state.tree) return;
    const sig = JSON.stringify([state.tree, state.filter, state.armed]);
    if (sig === state.sig) return;
    state.sig = sig;
    const rows = [];
    flatten(state.tree, 0, rows, state.filter);
    const now = Date.now();
    const trs = rows.map((r) => {
      if (r.more) {
        return h("tr", {class: "more-row"}, h("td", {colspan: 8},
          h("span", {class: "muted"}, `and ${num(r.more)} more under ${r.parent}: filter by path to find one`)));
      }
      const n = r.node;
      const name = n.path === "/" ? "/" : n.path.slice(n.path.lastIndexOf("/") + 1);
      const label = h("td", {class: "tree", title: n.path},
        h("span", {class: `mono ${r.children ? "strong" : ""}`}, name),
        r.children ? h("span", {class: "muted small"}, ` ${num(r.children)} child${r.children === 1 ? "" : "ren"}`) : null);
      label.style.paddingLeft = `${10 + r.depth * 18}px`;
      return h("tr", {dataset: {path: n.path}, class: n.restarts ? "restarted" : ""},
        label,
        h("td", {class: "small"}, String(n.kind ?? "")),
        h("td", null, h("span", {class: `state st-${String(n.state ?? "").replace(/[^a-z]/g, "")}`}, String(n.state ?? ""))),
        h("td", {class: "num"}, num(n.restarts ?? 0)),
        h("td", {class: "num"}, `${num(n.mailbox_depth ?? 0)} / ${num(n.mailbox_size ?? 0)}`),
        h("td", {class: "num"}, num(n.timers ?? 0)),
        h("td", {class: "nowrap muted small"}, n.started_at ? duration(now - n.started_at) : "—"),
        h("td", {class: "act"}, n.path === "/" ? null : killButton(n.path)));
    });
    const shown = rows.filter((r) => !r.more).length;
    note.textContent = `${num(shown)} actor${shown === 1 ? "" : "s"} shown`;
    fill(slot, table(["Actor", "Kind", "State", "Restarts", "Mailbox", "Timers", "Up for", ""], trs,
      {empty: "No actor matches this path.", cls: ["", "", "", "num", "num", "num", "", "act"]}));
  }

  async function refresh() {
    const answer = await api("/actors");
    if (!ctx.isCurrent()) return;
    state.tree = answer.tree;
    render();
  }

  return {refresh, unmount() {}};
}
