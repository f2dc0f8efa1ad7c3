// Definitions: every registered definition, by name, its versions and hashes,
// its steps and budgets, the workers holding it, and its JSON on demand.

import {api} from "./api.js";
import {h, fill, link, table, jsonBlock} from "./dom.js";
import {time, short, num} from "./format.js";

function stepsOf(def) {
  const steps = (def && def.steps) || [];
  return h("ol", {class: "steps"}, steps.map((s) => h("li", null,
    h("span", {class: "mono"}, String(s.id)), " ", h("span", {class: "tag"}, String(s.kind)),
    s.body && s.body !== s.id ? h("span", {class: "muted small"}, ` body ${s.body}`) : null)));
}

function budgetsOf(def) {
  const limits = Object.entries((def && def.budgets) || {}).filter(([, v]) => v !== null && v !== undefined);
  if (!limits.length) return h("span", {class: "muted"}, "none");
  return h("ul", {class: "plain small"}, limits.map(([k, v]) => h("li", null, h("span", {class: "mono"}, k), ` ${num(v)}`)));
}

export function mount(view, params, ctx) {
  const only = params.get("name") || "";
  const note = h("span", {class: "note"});
  const slot = h("div");
  fill(view, h("div", {class: "page-head"}, h("h1", null, "Definitions"), note),
    only ? h("p", null, "Only ", h("span", {class: "mono"}, only), ". ", h("a", {href: "#/definitions"}, "Show all")) : null,
    h("section", {class: "card flush"}, slot));
  let sig = "";

  async function refresh() {
    const answer = await api("/definitions");
    if (!ctx.isCurrent()) return;
    const text = JSON.stringify(answer);
    if (text === sig) return;  // keeps opened definitions open
    sig = text;
    const defs = (answer.definitions || []).filter((d) => !only || d.name === only);
    const names = new Set(defs.map((d) => d.name));
    note.textContent = `${num(names.size)} workflow${names.size === 1 ? "" : "s"} · ${num(defs.length)} version${defs.length === 1 ? "" : "s"}`;
    let previous = null;
    const rows = defs.map((d) => {
      const first = d.name !== previous;
      previous = d.name;
      const json = h("details", {class: "json-details"}, h("summary", null, "definition JSON"), jsonBlock(d.definition));
      return h("tr", {class: first ? "group-start" : "", dataset: {hash: d.definition_hash}},
        h("td", null, first ? h("div", null, h("span", {class: "strong"}, d.name), h("div", null,
          link(["runs"], {workflow: d.name}, h("span", {class: "small"}, "runs →")))) : null),
        h("td", {class: "mono"}, d.version ?? h("span", {class: "muted"}, "no version")),
        h("td", {class: "mono small", title: d.definition_hash}, short(d.definition_hash)),
        h("td", null, stepsOf(d.definition), json),
        h("td", null, budgetsOf(d.definition)),
        h("td", {class: "num"}, num((d.worker_ids || []).length)),
        h("td", {class: "nowrap muted small"}, time(d.registered_at)));
    });
    fill(slot, table(["Workflow", "Version", "Hash", "Steps", "Budgets", "Workers", "Registered"], rows,
      {empty: "No definition is registered: a worker registers them.", cls: ["", "", "", "", "", "num", ""]}));
  }

  return {refresh, unmount() {}};
}
