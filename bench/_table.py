"""The readable table of `python -m bench`: stepd beside PEERS.md's anchors and targets."""

from __future__ import annotations

from typing import Any

# PEERS.md "The anchors" (medians of two runs): a number, or a (low, high) range.
PEERS = ("Temporal", "Restate", "DBOS in-proc", "DBOS client+worker")
ANCHORS: dict[str, dict[str, Any]] = {
    "a_step": {"Temporal": 52.5, "Restate": (1.3, 1.5), "DBOS in-proc": 2.5, "DBOS client+worker": (4.2, 5.6)},
    "a_e2e": {"Temporal": 100, "Restate": 5.6, "DBOS in-proc": 5.8, "DBOS client+worker": 26},
    "b_steps": {"Temporal": 47, "Restate": (1500, 1700), "DBOS in-proc": 225, "DBOS client+worker": (180, 195)},
    "c_daemon": {"Temporal": 0.45, "Restate": 2.3, "DBOS in-proc": 0.7, "DBOS client+worker": (22, 27)},
    "d_rss": {"Temporal": 298, "Restate": (316, 329), "DBOS in-proc": 138, "DBOS client+worker": (101, 117)},
    "sync": {"Temporal": 24, "Restate": 1.2, "DBOS in-proc": 4, "DBOS client+worker": None},
}
FIGURES = {  # key: (label, unit, higher is better)
    "a_step": ("A per-step median", "ms", False),
    "a_e2e": ("A 1-step e2e median", "ms", False),
    "b_steps": ("B steps/s", "/s", True),
    "c_daemon": ("C idle daemon CPU", "%", False),
    "d_rss": ("D daemon RSS in B", "MB", False),
    "sync": ("syncs per extra step", "", False),
}
# PEERS.md "stepd's targets"; http: "no worse than Restate" (the worse end of its range).
TARGETS: dict[str, dict[str, float | None]] = {
    "websocket": {"a_step": 0.5, "a_e2e": 2, "b_steps": 5000, "c_daemon": 0.1, "d_rss": 120},
    "embedded": {"a_step": 0.25, "a_e2e": 1, "b_steps": 8000},
    "http": {"a_step": 1.5, "a_e2e": 5.6, "b_steps": 1500, "c_daemon": 2.3, "d_rss": 329},
}
TRANSPORT_ORDER = ("websocket", "http", "embedded")


def _mid(v: Any) -> float | None:
    if v is None:
        return None
    if isinstance(v, tuple):
        return float(v[0] + v[1]) / 2
    return float(v)


def _fmt_anchor(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, tuple):
        return f"{_num(v[0])}–{_num(v[1])}"
    return _num(v)


def _num(v: float | None, digits: int | None = None) -> str:
    if v is None:
        return "–"
    if digits is not None:
        return f"{v:,.{digits}f}"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    if abs(v) >= 1:
        return f"{v:.2f}"
    return f"{v:.3f}"


def _value(rows: dict[tuple[str, str], dict[str, Any]], transport: str, key: str) -> float | None:
    role = "process" if transport == "embedded" else "daemon"
    value: Any
    if key == "a_step":
        value = rows.get((transport, "A"), {}).get("per_step_ms_median")
    elif key == "a_e2e":
        value = rows.get((transport, "A"), {}).get("wf1_e2e_ms_median")
    elif key == "b_steps":
        value = rows.get((transport, "B"), {}).get("steps_per_s")
    elif key == "c_daemon":
        value = (rows.get((transport, "C"), {}).get("cpu_pct") or {}).get(role)
    elif key == "d_rss":
        value = (rows.get((transport, "D"), {}).get("peak_rss_mb") or {}).get(role)
    elif key == "sync":
        value = rows.get((transport, "durability"), {}).get("sync_per_extra_step")
    else:
        raise KeyError(key)
    return None if value is None else float(value)


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

    def line(r: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"

    return [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, body)]


def render(all_rows: list[dict[str, Any]], *, quick: bool = False) -> str:
    rows = {(r.get("transport", ""), r["workload"]): r for r in all_rows}
    transports = [t for t in TRANSPORT_ORDER if any(k[0] == t for k in rows)]
    out: list[str] = []
    base = rows.get(("", "baseline"), {}).get("synced_lmdb_commit_ms_median")
    mach = rows.get(("", "machine"), {})
    out.append(f"stepd beside PEERS.md (machine: {mach.get('cpus')} CPUs, {mach.get('cpu_model', '?')}; "
               f"baseline, one synced LMDB commit: median {_num(base)} ms, same disk, same run)"
               + ("  [--quick: fewer runs, shorter windows: not comparable]" if quick else ""))
    out.append("×Restate = stepd ÷ Restate (a range at its midpoint); for B higher is better, "
               "for the rest lower. http targets: no worse than Restate (the worse end of its range).")
    out.append("")
    header = ["figure", *PEERS, "stepd", "value", "×Restate", "target", "met"]
    body = []
    for key, (label, unit, higher) in FIGURES.items():
        first = True
        for t in transports:
            v = _value(rows, t, key)
            if v is None:
                continue
            anchors = ANCHORS[key]
            restate = _mid(anchors["Restate"])
            ratio = f"{v / restate:.2f}×" if restate else "–"
            target = TARGETS.get(t, {}).get(key)
            if target is None:
                tgt, met = "–", "–"
            else:
                tgt = ("≥ " if higher else "≤ ") + _num(target)
                met = "yes" if (v >= target if higher else v <= target) else "NO"
            cells = [f"{label} ({unit})" if unit else label] if first else [""]
            cells += [_fmt_anchor(anchors[p]) if first else "" for p in PEERS]
            name = t + (" (1 process)" if t == "embedded" and key in ("c_daemon", "d_rss") else "")
            cells += [name, _num(v), ratio, tgt, met]
            body.append(cells)
            first = False
    out += _table(header, body)

    # Beyond the anchors.
    out.append("")
    out.append("Other figures")
    other: list[list[str]] = []
    for t in transports:
        for workload, text in _others(rows, t):
            other.append([t, workload, text])
    out += _table(["transport", "workload", "figures"], other)
    return "\n".join(out)


def _others(rows: dict[tuple[str, str], dict[str, Any]], t: str) -> list[tuple[str, str]]:
    """The figures without an anchor, one line per workload."""
    out = []
    a = rows.get((t, "A"))
    if a:
        text = (f"per-step p95 {_num(a['per_step_ms_p95'])} ms; 1-step e2e p95 "
                f"{_num(a['wf1_e2e_ms_p95'])} ms ({a['runs']} + {a['wf1_runs']} runs)")
        out.append(("A", text))
    b = rows.get((t, "B"))
    if b:
        cpu = ", ".join(f"{k} {v:.2f} s ({b['cpu_pct_of_wall'][k]:.0f} % of wall)"
                        for k, v in b["cpu_s"].items())
        text = (f"{b['workflows']} wf in {b['total_s']:.2f} s = {_num(b['wf_per_s'])} wf/s; "
                f"CPU: {cpu}; worker concurrency {b['worker_concurrency']}")
        out.append(("B", text))
    c = rows.get((t, "C"))
    if c:
        cpu = ", ".join(f"{k} {v:.3f} %" for k, v in c["cpu_pct"].items())
        out.append(("C", f"{cpu} over {c['seconds']:.0f} s (resolution 10 ms of CPU)"))
    d = rows.get((t, "D"))
    if d:
        rss = ", ".join(f"{k} {v:.0f} MB" for k, v in d["peak_rss_mb"].items())
        out.append(("D", f"peak RSS {rss}"))
    dur = rows.get((t, "durability"))
    if dur and "error" in dur:
        out.append(("durability", f"not measured: {dur['error']}"))
    elif dur:
        text = (f"{_num(dur['sync_per_extra_step'])} fsync-family calls and "
                f"{_num(dur['commits_per_extra_step'])} storage commits per extra step; "
                f"{_num(dur['syncs_per_commit'])} syncs per commit; every commit synced: "
                f"{'yes' if dur['every_commit_synced'] else 'NO'}")
        out.append(("durability", text))
    e = rows.get((t, "E"))
    if e:
        anon0 = e.get("daemon_rss_detail_mb_before", {}).get("RssAnon", 0)
        anon1 = e.get("daemon_rss_detail_mb_asleep", {}).get("RssAnon", 0)
        text = (f"{e['runs']:,} sleepers, started at {_num(e['starts_per_s'])}/s: daemon RSS "
                f"{e['daemon_rss_mb_before']:.0f} -> {e['daemon_rss_mb_asleep']:.0f} MB asleep "
                f"(anon {anon0:.0f} -> {anon1:.0f} MB; {e['active_run_actors_asleep']} run actors); "
                f"all completed {e['wake_all_s']:.2f} s after the moment "
                f"({_num(e['wakes_per_s'])}/s), peak RSS while waking "
                f"{e['daemon_peak_rss_mb_during_wake']:.0f} MB")
        out.append(("E", text))
    f = rows.get((t, "F"))
    if f:
        cpu = ", ".join(f"{k} {v:.1f} %" for k, v in (f["cpu_pct"] or {}).items())
        text = (f"{'met' if f['ok'] else 'NOT MET'}: {f['leases']} leases x {f['hold_s']:.0f} s "
                f"({f['worker_processes']} worker process(es)): spurious expiries "
                f"{f['spurious_expiries']} (journal: {sum(f['journal_events'].values())} "
                f"orphan/recovery events, {f['unfinished_after_hold_plus_30s']} unfinished); "
                f"CPU over {f['window_s']:.0f} s: {cpu}")
        out.append(("F", text))
    return out
