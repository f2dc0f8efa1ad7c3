// Numbers, times and durations as people read them. Pure functions: text out.

const pad = (n, w = 2) => String(n).padStart(w, "0");

/** Epoch ms from an ISO-8601 string or a number; NaN when neither. */
export function toMs(value) {
  if (typeof value === "number") return value;
  if (typeof value === "string") return Date.parse(value);
  return NaN;
}

/** "2026-12-01 07:51:52" in the browser's time zone ("" for no time). */
export function time(value) {
  const ms = toMs(value);
  if (!Number.isFinite(ms)) return "";
  const d = new Date(ms);
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ` +
    `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

/** "07:51:52.262": a clock time with milliseconds. */
export function clock(value) {
  const ms = toMs(value);
  if (!Number.isFinite(ms)) return "";
  const d = new Date(ms);
  return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}.${pad(d.getMilliseconds(), 3)}`;
}

/** A duration: "0 ms", "812 ms", "4.2 s", "3 min 4 s", "2 h 3 min", "3 d 4 h". */
export function duration(ms) {
  if (!Number.isFinite(ms)) return "";
  ms = Math.max(0, Math.round(ms));
  if (ms < 1000) return `${ms} ms`;
  if (ms < 10_000) return `${(ms / 1000).toFixed(2)} s`;
  if (ms < 60_000) return `${(ms / 1000).toFixed(1)} s`;
  const s = Math.floor(ms / 1000);
  if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  return `${Math.floor(s / 86400)} d ${Math.floor((s % 86400) / 3600)} h`;
}

/** "12 s ago", "3 min ago", or the date for anything older than a day. */
export function ago(value, now = Date.now()) {
  const ms = toMs(value);
  if (!Number.isFinite(ms)) return "";
  const d = now - ms;
  if (d < 1500) return "just now";
  if (d < 60_000) return `${Math.round(d / 1000)} s ago`;
  if (d < 3_600_000) return `${Math.round(d / 60_000)} min ago`;
  if (d < 86_400_000) return `${Math.round(d / 3_600_000)} h ago`;
  return time(ms);
}

/** 1234567 -> "1,234,567" (null -> "—"). */
export function num(n) {
  if (n === null || n === undefined || !Number.isFinite(Number(n))) return "—";
  return Number(n).toLocaleString("en-US");
}

/** A cost in USD: "$0.0123", "$12.34". */
export function usd(x) {
  const v = Number(x);
  if (!Number.isFinite(v)) return "—";
  if (v === 0) return "$0";
  if (Math.abs(v) < 0.01) return "$" + v.toFixed(6).replace(/0+$/, "");
  return "$" + v.toFixed(4).replace(/0{1,2}$/, "");
}

/** The first 12 hex digits of a hash. */
export function short(hash) {
  return typeof hash === "string" ? hash.slice(0, 12) : "";
}

/** JSON on one line, cut to `max` characters. */
export function inline(value, max = 120) {
  let text;
  try { text = JSON.stringify(value); } catch { text = String(value); }
  if (text === undefined) text = "";
  return text.length > max ? text.slice(0, max - 1) + "…" : text;
}

/** A datetime-local input's value ("2026-12-01T07:51") for epoch ms, local time. */
export function localInput(ms) {
  const d = new Date(ms);
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())}T${pad(d.getHours())}:${pad(d.getMinutes())}`;
}

export const TERMINAL = new Set(["completed", "failed", "cancelled", "timed_out"]);
export const STATUSES = ["running", "waiting", "sleeping", "completed", "failed", "cancelled", "timed_out"];
