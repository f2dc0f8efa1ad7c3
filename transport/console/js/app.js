// The console's shell: who is signed in, which page shows, and live updates.
//
// Pages are modules exporting `mount(view, params, ctx)`, which renders the
// page and returns `{refresh, unmount}`. While the tab is visible the shell
// calls the page's `refresh` every POLL_MS (one call at a time: a slow
// answer delays the next poll, it never stacks them); a hidden tab polls
// nothing. See docs/console.md for why this polls rather than streams.

import {api, auth, ApiError, validKey} from "./api.js";
import {h, fill} from "./dom.js";
import {clock} from "./format.js";
import * as runs from "./runs.js";
import * as run from "./run.js";
import * as workers from "./workers.js";
import * as actors from "./actors.js";
import * as definitions from "./definitions.js";
import * as schedules from "./schedules.js";
import * as daemon from "./daemon.js";

const POLL_MS = 2000;

const view = document.getElementById("view");
const liveEl = document.getElementById("live");
const whoEl = document.getElementById("who");
const signoutEl = document.getElementById("signout");

/** What the signed-in key may do: "admin" (actions) or "read"; keyless: whether the daemon has keys. */
const session = {role: null, keyless: false};

let current = null;       // the mounted page: {refresh, unmount}
let timer = null;
let busy = false;
let generation = 0;       // bumps on every navigation: late answers of an old page are dropped

function parseHash() {
  const raw = location.hash.replace(/^#/, "") || "/runs";
  const [path, query = ""] = raw.split("?", 2);
  const parts = path.split("/").filter(Boolean).map((p) => {
    try { return decodeURIComponent(p); } catch { return p; }
  });
  return {parts, params: new URLSearchParams(query)};
}

function pageFor(parts) {
  const [first, second] = parts;
  if (first === "runs" && parts.length === 2) return {page: run, name: "runs", arg: second};
  if (first === "runs" && parts.length === 1) return {page: runs, name: "runs"};
  if (first === "workers") return {page: workers, name: "workers"};
  if (first === "actors") return {page: actors, name: "actors"};
  if (first === "definitions") return {page: definitions, name: "definitions"};
  if (first === "schedules") return {page: schedules, name: "schedules"};
  if (first === "daemon") return {page: daemon, name: "daemon"};
  return null;
}

function setLive(state, text) {
  liveEl.className = `live ${state}`;
  liveEl.textContent = text;
}

function showWho() {
  if (session.role === null) {
    whoEl.textContent = "";
    signoutEl.hidden = true;
    return;
  }
  if (session.keyless) {
    whoEl.textContent = "no keys · loopback only";
    whoEl.title = "This daemon has no API keys: it serves 127.0.0.1 only, and everyone on this machine is admin.";
  } else {
    whoEl.textContent = session.role === "admin" ? "admin key" : "read key";
    whoEl.title = session.role === "admin" ? "This key may act (kill actors; retry, fork and cancel runs; manage schedules)." : "This key may read; it sees no actions.";
  }
  signoutEl.hidden = session.keyless;
}

/** Find out who we are: a 401 asks for a key, a 403 says the key cannot read. */
async function signIn() {
  session.role = null;
  showWho();
  try {
    await api("/stats");
  } catch (err) {
    if (err instanceof ApiError && (err.status === 401 || err.status === 403)) {
      const problem = err.status === 403
        ? "This key may not read runs (it lacks the read scope). Use a read or admin key."
        : auth.key ? "The daemon refused this key." : null;
      auth.clear();  // a refused key is not sent again
      showKeyForm(problem);
      return false;
    }
    showUnreachable(err);
    return false;
  }
  session.keyless = !auth.key;
  try {
    await api("/actors");
    session.role = "admin";
  } catch (err) {
    if (err instanceof ApiError && err.status === 403) session.role = "read";
    else { showUnreachable(err); return false; }
  }
  if (!session.keyless) {
    // A daemon without keys ignores the header: then the key proves nothing.
    session.keyless = await isKeyless();
  }
  showWho();
  return true;
}

async function isKeyless() {
  try {
    const r = await fetch("/v1/api/stats", {cache: "no-store", credentials: "omit"});
    return r.ok;
  } catch { return false; }
}

function showUnreachable(err) {
  stopPolling();
  setLive("down", "daemon unreachable");
  fill(view, h("section", {class: "card notice"},
    h("h2", null, "The daemon does not answer"),
    h("p", null, String(err && err.message ? err.message : err)),
    h("p", {class: "muted"}, "Retrying every few seconds.")));
  setTimeout(start, 3000);
}

function showKeyForm(problem) {
  stopPolling();
  if (current) { current.unmount?.(); current = null; }
  setLive("idle", "signed out");
  const input = h("input", {type: "password", id: "key", name: "key", autocomplete: "off",
    spellcheck: "false", placeholder: "API key", "aria-label": "API key", required: true});
  const error = h("p", {class: "error", role: "alert"}, problem || "");
  if (!problem) error.hidden = true;
  const form = h("form", {class: "key-form", onsubmit: (ev) => {
    ev.preventDefault();
    const key = input.value.trim();
    if (!validKey(key)) {
      error.hidden = false;
      error.textContent = "A key is visible ASCII without spaces.";
      return;
    }
    auth.set(key);
    start();
  }},
  h("h2", null, "Sign in"),
  h("p", {class: "muted"}, "This daemon has API keys. A read key sees everything; an admin key may also act: kill actors, retry, fork and cancel runs, manage schedules. " +
    "The key stays in this tab (sessionStorage) and is sent only to this daemon."),
  input, h("button", {type: "submit", class: "primary"}, "Sign in"), error);
  fill(view, h("div", {class: "center"}, form));
  input.focus();
}

function highlight(name) {
  for (const a of document.querySelectorAll("nav.tabs a")) {
    a.classList.toggle("active", a.dataset.page === name);
  }
}

async function navigate() {
  if (session.role === null) return;
  const {parts, params} = parseHash();
  const found = pageFor(parts);
  if (!found) { location.hash = "#/runs"; return; }
  generation += 1;
  const mine = generation;
  if (current) current.unmount?.();
  current = null;
  highlight(found.name);
  fill(view);
  const ctx = {
    session,
    params,
    arg: found.arg,
    isCurrent: () => mine === generation,
    /** A page reports a failed call: 401 signs out, others show in the live badge. */
    failed(err) {
      if (err instanceof ApiError && err.status === 401) { auth.clear(); start(); return true; }
      if (err instanceof ApiError && err.status === 0) setLive("down", "daemon unreachable");
      return false;
    },
  };
  current = found.page.mount(view, params, ctx);
  document.title = `${found.arg ? found.arg + " · " : ""}${found.name} · stepd`;
  await tick();
  schedule();
}

async function tick() {
  if (!current || busy) return;
  busy = true;
  const mine = generation;
  try {
    await current.refresh();
    if (mine === generation) setLive("ok", `live · ${clock(Date.now()).slice(0, 8)}`);
  } catch (err) {
    if (mine === generation && !(err instanceof ApiError && err.status === 401)) {
      setLive("down", err instanceof ApiError && err.status === 0 ? "daemon unreachable" : "update failed");
    }
    if (err instanceof ApiError && err.status === 401) { auth.clear(); start(); }
  } finally {
    busy = false;
  }
}

function schedule() {
  stopPolling();
  if (document.visibilityState !== "visible") { setLive("idle", "paused (tab hidden)"); return; }
  timer = setTimeout(async () => { await tick(); schedule(); }, POLL_MS);
}

function stopPolling() {
  if (timer !== null) clearTimeout(timer);
  timer = null;
}

async function start() {
  stopPolling();
  setLive("idle", "connecting");
  if (await signIn()) await navigate();
}

document.addEventListener("visibilitychange", () => {
  if (document.visibilityState === "visible" && current) { tick().then(schedule); } else stopPolling();
});
window.addEventListener("hashchange", () => { navigate(); });
signoutEl.addEventListener("click", () => { auth.clear(); session.role = null; start(); });

start();
