"""``python -m bench --otlp``: the A-D section with OpenTelemetry export off and on.

Each repeat runs the section twice per transport, export off then on, on a
fresh daemon each time; with export on the daemon sends to a local OTLP/HTTP
sink (`bench._otlp_sink`, a thread of the parent process that decodes and
counts). Rows carry ``"otlp": "off"`` or ``"on"``; the main table shows the
``off`` figures; `table` sets B off beside B on (docs/otel.md quotes it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["export_child", "sink_for", "table", "variants"]


def export_child(ppid: int) -> int | None:
    """The PID of the span export's child process (``stepd._otel_child``) of ``ppid``, if any:
    its CPU counts as the daemon's (B reports it as ``otel_export``)."""
    for task in Path(f"/proc/{ppid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for pid in children:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"stepd._otel_child" in cmdline:
                return int(pid)
    return None


@contextlib.contextmanager
def sink_for(enabled: bool) -> Iterator[Any]:
    """A counting OTLP sink on 127.0.0.1 while inside (None when not ``enabled``)."""
    if not enabled:
        yield None
        return
    from bench._otlp_sink import otlp_sink  # needs opentelemetry-proto: only with --otlp

    with otlp_sink(keep=False) as sink:
        yield sink


def variants(sink: Any) -> list[tuple[str | None, list[str]]]:
    """(tag, child arguments) per run of a section: one untagged run without a sink."""
    if sink is None:
        return [(None, [])]
    return [("off", []), ("on", [f"--otlp-endpoint={sink.url}"])]


def _cpu(row: dict[str, Any]) -> str:
    cpu = row.get("cpu_s") or {}
    key = "daemon" if "daemon" in cpu else "process"
    child = cpu.get("otel_export")
    return f"{cpu.get(key, '?')} ({key})" + ("" if child is None else f" + {child} (export)")


def table(rows: list[dict[str, Any]]) -> str:
    """B with export off beside B with export on, per transport (medians when repeated)."""
    medians = [r for r in rows if r.get("workload") == "B" and "otlp" in r and "repeat" not in r]
    title = ("B with OpenTelemetry export off and on (medians of the repeats; same run, turns "
             "taken; exported and dropped: spans and writes so far when B ended)")
    header = (f"{'transport':<10} {'export':<6} {'wf/s':>8} {'steps/s':>8} {'total s':>8} "
              f"{'cpu s':>30} {'exported':>9} {'dropped':>8}")
    lines = [title, header]
    for r in medians:
        export = r.get("otlp_export") or {}
        lines.append(f"{r.get('transport', ''):<10} {r['otlp']:<6} {r.get('wf_per_s', '?'):>8} "
                     f"{r.get('steps_per_s', '?'):>8} {r.get('total_s', '?'):>8} {_cpu(r):>30} "
                     f"{export.get('exported', '-'):>9} {export.get('dropped', '-'):>8}")
    return "\n".join(lines)
