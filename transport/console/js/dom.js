// The one way the console builds its page: elements and text nodes.
//
// Everything shown comes from the daemon, and much of it was written by
// workers and clients (worker names, outputs, messages, span names, run and
// step ids): it is only ever put in the page as text (`textContent`, text
// nodes) or as an attribute value (`setAttribute`), never parsed as HTML.
// Nothing here touches innerHTML, outerHTML, insertAdjacentHTML or
// document.write, and the Content-Security-Policy (Trusted Types) makes the
// browser refuse them should any code try.

/**
 * A page's status banner for the answers to its actions: `el` goes in the
 * page, `say(kind, ...text)` shows it ("ok" or "bad", text parts as `fill`).
 */
export function statusBanner() {
  const el = h("div", {class: "banner", role: "status", hidden: true});
  return {el, say(kind, ...text) { el.hidden = false; el.className = `banner ${kind}`; fill(el, ...text); }};
}

/**
 * A new element: h("td", {class: "mono", title: id}, "text", child, [more]).
 *
 * Property keys are the console's own (never data). Values are data:
 * `text` sets textContent, `class` the class name, `style` CSS properties
 * through the CSSOM (allowed by the CSP, unlike style attributes), `on<event>`
 * a listener, `href` an internal route only (see `route`), anything else an
 * attribute value. Children: nodes, or anything else as text.
 */
export function h(tag, props, ...children) {
  const el = document.createElement(tag);
  if (props) {
    for (const [key, value] of Object.entries(props)) {
      if (value === undefined || value === null || value === false) continue;
      if (key === "class") el.className = value;
      else if (key === "text") el.textContent = String(value);
      else if (key === "href") el.setAttribute("href", route(value));
      else if (key === "style") {
        for (const [name, v] of Object.entries(value)) el.style.setProperty(name, String(v));
      } else if (key === "dataset") {
        for (const [name, v] of Object.entries(value)) el.dataset[name] = String(v);
      } else if (key.startsWith("on") && typeof value === "function") {
        el.addEventListener(key.slice(2), value);
      } else if (value === true) el.setAttribute(key, "");
      else el.setAttribute(key, String(value));
    }
  }
  append(el, children);
  return el;
}

/** Append children (nodes, strings, numbers, nested arrays; null and false skipped). */
export function append(el, children) {
  for (const child of [children].flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : String(child));  // a string becomes a text node
  }
  return el;
}

/** Replace an element's children. */
export function fill(el, ...children) {
  el.replaceChildren();
  return append(el, children);
}

/**
 * An href for a console route. Only "#/..." routes are links: a value from
 * the daemon can never become a javascript: or another site's URL, because
 * callers build routes from encodeURIComponent'd ids (`link`).
 */
export function route(value) {
  const text = String(value);
  if (!text.startsWith("#/")) throw new Error("not a console route");
  return text;
}

/** A link to a console route built from parts, each part encoded: link("runs", runId). */
export function link(parts, query, ...children) {
  let href = "#/" + parts.map((p) => encodeURIComponent(String(p))).join("/");
  if (query) {
    const q = new URLSearchParams();
    for (const [k, v] of Object.entries(query)) if (v !== undefined && v !== null && v !== "") q.set(k, v);
    const s = q.toString();
    if (s) href += "?" + s;
  }
  return h("a", {href}, ...children);
}

/** A pre of pretty-printed JSON (as text). */
export function jsonBlock(value, cls = "json") {
  return h("pre", {class: cls}, value === undefined ? "" : JSON.stringify(value, null, 2));
}

/** A status badge. */
export function badge(status) {
  return h("span", {class: `badge s-${String(status).replace(/[^a-z_]/g, "")}`}, String(status).replace("_", " "));
}

/** A definition list from [label, value] pairs (values: nodes or text; null skipped). */
export function facts(pairs, cls = "facts") {
  const dl = h("dl", {class: cls});
  for (const [label, value] of pairs) {
    if (value === null || value === undefined) continue;
    dl.append(h("dt", null, label), h("dd", null, value));
  }
  return dl;
}

/** A table from headers and rows of cells (nodes or text); `cls` per column optional. */
export function table(headers, rows, {cls = [], empty = "Nothing here.", tableClass = "grid"} = {}) {
  const thead = h("thead", null, h("tr", null, headers.map((t, i) => h("th", {class: cls[i]}, t))));
  const tbody = h("tbody");
  for (const row of rows) {
    const tr = row instanceof HTMLTableRowElement ? row
      : h("tr", null, row.map((c, i) => h("td", {class: cls[i]}, c)));
    tbody.append(tr);
  }
  if (!rows.length) tbody.append(h("tr", {class: "empty"}, h("td", {colspan: headers.length}, empty)));
  return h("div", {class: "table-wrap"}, h("table", {class: tableClass}, thead, tbody));
}

/** A card section with a title and an optional note beside it. */
export function section(title, note, ...children) {
  return h("section", {class: "card"},
    h("div", {class: "card-head"}, h("h2", null, title), note ? h("span", {class: "note"}, note) : null),
    ...children);
}
