"""Issue 16's targets as ratios of one cycle's rows, and their medians over the cycles (pure).

`python -m bench --vs-restate` runs Restate and stepd side by side in cycles
(bench/_vs_restate.py); this module only reads the JSON rows of one cycle and
says, for every target of issue 16 (and PEERS.md), stepd's figure, the
reference it is divided by (Restate's figure of the same cycle, the synced
LMDB commit of the same cycle, or 1 for an absolute limit), the ratio and
whether it meets the target. The figures move by tens of percent from one run
to the next on this machine, so a target is judged on the ratio within one
cycle, and the summary is the median of the per-cycle ratios.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

Rows = Mapping[str, Mapping[str, Mapping[str, Any]]]
"""engine-or-transport -> workload -> row: ``restate``, ``websocket``, ``http``, ``embedded``."""


def _get(rows: Rows, who: str, workload: str, *path: str) -> float | None:
    value: Any = rows.get(who, {}).get(workload)
    for key in path:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _sum(rows: Rows, who: str, workload: str, key: str) -> float | None:
    values = rows.get(who, {}).get(workload, {}).get(key)
    if not isinstance(values, Mapping) or not values:
        return None
    return float(sum(values.values()))


def _daemon(transport: str) -> str:
    """The daemon's role in stepd's rows (embedded: the one process)."""
    return "process" if transport == "embedded" else "daemon"


@dataclass(frozen=True)
class Figure:
    """One target: stepd's value over a reference, ``<=`` or ``>=`` a bound."""

    name: str
    transport: str
    value: Callable[[Rows], float | None]
    reference: Callable[[Rows], float | None]
    against: str
    """``restate``, ``synced commit`` or ``absolute`` (reference 1)."""
    bound: float | None
    higher_is_better: bool = False

    def judge(self, rows: Rows, commit_ms: float | None) -> dict[str, Any]:
        """This figure in one cycle: the two values, the ratio, met or not."""
        value = self.value(rows)
        if self.against == "synced commit":
            ref: float | None = commit_ms
        elif self.against == "absolute":
            ref = 1.0
        else:
            ref = self.reference(rows)
        ratio = None if value is None or not ref else round(value / ref, 3)
        met = None
        if ratio is not None and self.bound is not None:
            met = ratio >= self.bound if self.higher_is_better else ratio <= self.bound
        return {"figure": self.name, "transport": self.transport, "against": self.against,
                "stepd": value, "reference": ref, "ratio": ratio, "target": self.target(),
                "met": met}

    def target(self) -> str:
        if self.bound is None:
            return "-"
        unit = "" if self.against == "absolute" else "x"
        return f"{'>=' if self.higher_is_better else '<='} {self.bound:g}{unit}"


def _figures() -> list[Figure]:
    """Issue 16's targets, in its order (PEERS.md's for embedded 1-step; C and D absolute)."""
    a_step: dict[str, float | None] = {"websocket": 0.6, "http": 1.0, "embedded": None}
    a_one: dict[str, float | None] = {"websocket": 0.4, "http": 1.0, "embedded": 0.3}
    b_rate: dict[str, float | None] = {"websocket": 2.5, "http": 1.0, "embedded": 2.5}
    out: list[Figure] = []
    for t in ("websocket", "http", "embedded"):
        out.append(Figure("A per-step median", t,
                          lambda r, t=t: _get(r, t, "A", "per_step_ms_median"),
                          lambda r: _get(r, "restate", "A", "per_step_ms_median"),
                          "restate", a_step[t]))
        if t == "embedded":
            out.append(Figure("A per-step / synced commit", t,
                              lambda r: _get(r, "embedded", "A", "per_step_ms_median"),
                              lambda r: None, "synced commit", 2.0))
        out.append(Figure("A 1-step e2e median", t,
                          lambda r, t=t: _get(r, t, "A", "wf1_e2e_ms_median"),
                          lambda r: _get(r, "restate", "A", "wf1_e2e_ms_median"),
                          "restate", a_one[t]))
        out.append(Figure("B steps/s", t,
                          lambda r, t=t: _get(r, t, "B", "steps_per_s"),
                          lambda r: _get(r, "restate", "B", "steps_per_s"),
                          "restate", b_rate[t], higher_is_better=True))
        out.append(Figure("B CPU s, all processes", t,
                          lambda r, t=t: _sum(r, t, "B", "cpu_s"),
                          lambda r: _sum(r, "restate", "B", "cpu_s"), "restate", None))
        out.append(Figure("C idle daemon CPU %", t,
                          lambda r, t=t: _get(r, t, "C", "cpu_pct", _daemon(t)),
                          lambda r: None, "absolute", 0.1 if t != "embedded" else None))
        out.append(Figure("C idle daemon CPU vs Restate", t,
                          lambda r, t=t: _get(r, t, "C", "cpu_pct", _daemon(t)),
                          lambda r: _get(r, "restate", "C", "cpu_pct", "server"), "restate", None))
        out.append(Figure("D daemon peak RSS in B (MB)", t,
                          lambda r, t=t: _get(r, t, "D", "peak_rss_mb", _daemon(t)),
                          lambda r: None, "absolute", 120.0 if t != "embedded" else None))
        out.append(Figure("D daemon RSS vs Restate", t,
                          lambda r, t=t: _get(r, t, "D", "peak_rss_mb", _daemon(t)),
                          lambda r: _get(r, "restate", "D", "peak_rss_mb", "server"), "restate",
                          None))
    return out


FIGURES = _figures()


def cycle_ratios(rows: Rows, commit_ms: float | None, transports: Iterable[str] | None = None
                 ) -> list[dict[str, Any]]:
    """Every figure of one cycle (only those of ``transports`` when given)."""
    keep = None if transports is None else set(transports)
    return [f.judge(rows, commit_ms) for f in FIGURES if keep is None or f.transport in keep]


def median_ratios(cycles: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per figure: its ratio in each cycle and their median (judged against the target)."""
    by_key: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for cycle in cycles:
        for row in cycle:
            by_key.setdefault((row["figure"], row["transport"]), []).append(row)
    out = []
    for (name, transport), rows in by_key.items():
        ratios = [r["ratio"] for r in rows]
        present = [x for x in ratios if x is not None]
        median = round(statistics.median(present), 3) if present else None
        figure = next(f for f in FIGURES if f.name == name and f.transport == transport)
        met = None
        if median is not None and figure.bound is not None:
            met = (median >= figure.bound) if figure.higher_is_better else (median <= figure.bound)
        stepd_values = [r["stepd"] for r in rows if r["stepd"] is not None]
        refs = [r["reference"] for r in rows if r["reference"] is not None]
        out.append({"figure": name, "transport": transport, "against": figure.against,
                    "ratios": ratios, "median": median, "target": figure.target(), "met": met,
                    "stepd_median": statistics.median(stepd_values) if stepd_values else None,
                    "reference_median": statistics.median(refs) if refs else None})
    return out


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.3g}" if abs(x) < 1 else f"{x:.2f}"


def render(medians: list[dict[str, Any]]) -> str:
    """The summary table: per figure the per-cycle ratios, their median, the target."""
    n = max((len(m["ratios"]) for m in medians), default=0)
    head = (["figure", "transport", "against"] + [f"cycle {i + 1}" for i in range(n)]
            + ["median", "stepd", "reference", "target", "met"])
    lines = [head]
    for m in medians:
        met = "-" if m["met"] is None else ("yes" if m["met"] else "NO")
        lines.append([m["figure"], m["transport"], m["against"]]
                     + [_fmt(x) for x in m["ratios"]] + [""] * (n - len(m["ratios"]))
                     + [_fmt(m["median"]), _fmt(m["stepd_median"]), _fmt(m["reference_median"]),
                        m["target"], met])
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    text = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in lines]
    text.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(text)
