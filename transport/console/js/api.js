// Calls to the daemon's HTTP API (transport/openapi.json), same origin only.
//
// The key lives in sessionStorage: it survives a reload of the tab but not
// the tab itself, and no other tab or site sees it. It is sent as
// `Authorization: Bearer <key>`; no cookie is ever used, so another site
// cannot make the browser call the API with it.

const KEY = "stepd.console.key";

export const auth = {
  get key() {
    try { return sessionStorage.getItem(KEY); } catch { return null; }
  },
  set(key) { sessionStorage.setItem(KEY, key); },
  clear() { try { sessionStorage.removeItem(KEY); } catch { /* storage disabled */ } },
};

/** A key the daemon can accept: visible ASCII without spaces (docs/http-api.md). */
export function validKey(key) {
  return typeof key === "string" && /^[\x21-\x7e]{1,4096}$/.test(key);
}

export class ApiError extends Error {
  constructor(status, body) {
    const message = body && typeof body.message === "string" ? body.message
      : status === 0 ? "the daemon cannot be reached" : `HTTP ${status}`;
    super(message);
    this.status = status;
    this.code = body && typeof body.error === "string" ? body.error : null;
    this.field = body && typeof body.field === "string" ? body.field : null;
  }
}

/** Why an action was refused, as text parts for a banner: "<what> refused: <field>: <message>". */
export function refusal(what, err) {
  return [`${what} refused: `, err instanceof ApiError && err.field ? `${err.field}: ` : "",
    err instanceof ApiError ? err.message : String(err)];
}

/**
 * Call the API: api("/runs", {query: {...}}), api("/actors/kill", {method: "POST", body}).
 * `path` is built by callers with encodeURIComponent for every id.
 * Resolves to the decoded JSON body; rejects with an ApiError.
 */
export async function api(path, {method = "GET", query = null, body, signal} = {}) {
  let url = "/v1/api" + path;
  if (query) {
    const q = new URLSearchParams();
    for (const [k, v] of Object.entries(query)) {
      if (v !== undefined && v !== null && v !== "") q.set(k, String(v));
    }
    const text = q.toString();
    if (text) url += "?" + text;
  }
  const headers = {Accept: "application/json"};
  const key = auth.key;
  if (key && validKey(key)) headers.Authorization = "Bearer " + key;
  const init = {method, headers, cache: "no-store", credentials: "omit", redirect: "error", signal};
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(url, init);
  } catch (err) {
    if (err && err.name === "AbortError") throw err;
    throw new ApiError(0, null);
  }
  let data = null;
  try { data = await response.json(); } catch { data = null; }
  if (!response.ok) throw new ApiError(response.status, data);
  return data;
}
