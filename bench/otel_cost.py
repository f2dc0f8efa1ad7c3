"""``python -m bench.otel_cost``: what span export costs the embedded process, counted per step.

    python -m bench.otel_cost [--runs 300] [--repeat 3] [--calls] [--json]

Wall times on a loaded 2-core machine say little (docs/otel.md), so this
counts instead, over a fixed workload: ``--runs`` x seq(3) (B's workflow, at
most 100 started at once, the SDK's default worker concurrency) in
``stepd.embedded``, export off and on taking turns, each on a fresh daemon
after a warm-up. Export goes to a counting OTLP/HTTP sink in a process of its
own (``python -m bench._otlp_sink``), so that its CPU is told apart.

Per step, window minus nothing (the daemon is idle before and after):

* ``proc_ms``: CPU of the embedded process (every thread: the event loop,
  the storage writer, the export thread), from ``getrusage``;
* ``main_ms``, ``export_ms``, ``writer_ms``: the CPU of those threads
  (``/proc/self/task/TID/schedstat``, nanoseconds; the export child's too);
* ``main_wait_ms``: how long the event loop's thread sat runnable, waiting
  for a core (schedstat): what the child and the sink take from it shows
  here, and in ``nivcsw`` (involuntary context switches of the process);
* ``main_vcsw``, ``main_ivcsw``: the event loop thread's voluntary context
  switches (it sleeps for each wait on the GIL, and on epoll when it has
  nothing to do) and involuntary ones (preempted);
* ``export_vcsw``, ``writer_vcsw``, ``child_vcsw``: the voluntary switches of
  the export thread (if any), the storage writer and the export child: how
  often each wakes up, per step;
* ``gc_ms``: CPU the collector took on the thread that ran it (``gc.callbacks``);
* ``gc1_per_1k``, ``gc2_per_1k``: the collector's generation-1 and -2 runs per 1,000 steps;
* ``child_ms``, ``sink_ms``: CPU of the export child and of the sink;
* ``pipe_bytes``: bytes the child read from its pipe (``/proc/PID/io``).

Off and on take turns ABBA (off first in odd turns, on first in even ones);
the table gives the medians of each and the median of the turns'
differences (``on-off``).

With ``--neighbour`` each turn has a third window, ``busy``: export off,
and beside the daemon a process at nice 10 that spins 20 ms in every 200 (a
tenth of a core, about the export child's share here) and does nothing
stepd does; its CPU shows as ``child_ms``. If the loop thread's CPU per
step rises as much in ``busy`` as in ``on``, what raises it is any work on
the other core, not export's.

With ``--calls`` the same window is counted with cProfile instead (the
recorder of `bench.calls`: main thread by cProfile, other threads by a
profile gate): Python and C calls per step of the main thread and of the
export thread. Profiling slows everything, so its CPU figures are not shown.

The window opens after the warm-up, a settle and (export on) the warm-up's
spans sent, and closes when the last
result is back and, with export on, the export has gone quiet (nothing
queued, the collector's count still for 1.2 s), bounded to 15 s; off, it
closes after the same fixed tail (1.5 s).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import anyio

from bench import _otlp, _setups
from bench._calls_agent import Recorder
from bench._procs import CLK_TCK
from bench._workloads import INFLIGHT, SEQ, expected, fresh_key, gather_limited, warm_up

STEPS = 3
COMMIT = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                        cwd=Path(__file__).resolve().parent.parent, check=False).stdout.strip()
SETTLE_S = 1.25
TAIL_S = 1.5
QUIET_S = 0.3
QUIET_FOR_S = 1.2
DRAIN_BOUND_S = 15.0
EXPORT_THREAD = "stepd-otel-export"
WRITER_THREAD = "stepd-storage-writer"


def _task_cpu_s(pid: int | str, tid: int | None = None) -> float:
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


def _schedstat(path: str) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable waiting for one), in nanoseconds' resolution."""
    try:
        on, wait, _ = Path(path).read_text().split()
    except (OSError, ValueError):
        return 0.0, 0.0
    return int(on) / 1e9, int(wait) / 1e9


def _switches(path: str) -> tuple[float, float]:
    """A thread's (or process's main thread's) voluntary and involuntary context switches
    (``/proc/.../status``): it sleeps once per voluntary one (a wait for the GIL, for a
    lock, for I/O or for its timer: a wake-up each), and is preempted per involuntary one."""
    vol = invol = 0.0
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                vol = float(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches:"):
                invol = float(line.split()[1])
    except OSError:
        pass
    return vol, invol


class GcClock:
    """CPU the collector spends on the thread that runs it (``gc.callbacks``; the event loop's
    thread, nearly always): writes held longer survive into older generations, which every
    later collection of those generations walks again."""

    def __init__(self) -> None:
        self.cpu_s = 0.0
        self._began = 0.0
        gc.callbacks.append(self._hear)

    def _hear(self, phase: str, _info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.thread_time()
        elif self._began:
            self.cpu_s += time.thread_time() - self._began
            self._began = 0.0


GC_CLOCK = GcClock()


def _rchar(pid: int | None) -> int:
    if pid is None:
        return 0
    try:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _thread_tid(prefix: str) -> int | None:
    for t in threading.enumerate():
        if t.name.startswith(prefix):
            return t.native_id
    return None


def snapshot(child: int | None, sink: int | None) -> dict[str, float]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    main = threading.main_thread().native_id
    assert main is not None
    export, writer = _thread_tid(EXPORT_THREAD), _thread_tid(WRITER_THREAD)
    main_on, main_wait = _schedstat(f"/proc/self/task/{main}/schedstat")
    main_vcsw, main_ivcsw = _switches(f"/proc/self/task/{main}/status")
    export_vcsw = 0.0 if export is None else _switches(f"/proc/self/task/{export}/status")[0]
    writer_vcsw = 0.0 if writer is None else _switches(f"/proc/self/task/{writer}/status")[0]
    child_vcsw = 0.0 if child is None else _switches(f"/proc/{child}/status")[0]
    return {
        "proc": ru.ru_utime + ru.ru_stime,
        "nivcsw": float(ru.ru_nivcsw),
        "main": main_on,
        "main_wait": main_wait,
        "main_vcsw": main_vcsw,
        "main_ivcsw": main_ivcsw,
        "export_vcsw": export_vcsw,
        "writer_vcsw": writer_vcsw,
        "child_vcsw": child_vcsw,
        "gc": GC_CLOCK.cpu_s,
        "export": 0.0 if export is None else _schedstat(f"/proc/self/task/{export}/schedstat")[0],
        "writer": 0.0 if writer is None else _schedstat(f"/proc/self/task/{writer}/schedstat")[0],
        "child": 0.0 if child is None else _schedstat(f"/proc/{child}/schedstat")[0],
        "sink": 0.0 if sink is None else _task_cpu_s(sink),
        "pipe": float(_rchar(child)),
        **{f"gc{i}": float(g["collections"]) for i, g in enumerate(gc.get_stats())},
    }


async def workload(s: Any, runs: int) -> None:
    wf, want = SEQ[STEPS], expected(STEPS)

    async def start(_: int) -> Any:
        return await s.client.start(wf, idempotency_key=fresh_key("otelcost"))

    async def wait(run: Any) -> None:
        if await run.result(timeout=300) != want:
            raise SystemExit(f"otel_cost: run {run.run_id} returned a wrong result")

    started = await gather_limited(list(range(runs)), start, INFLIGHT)
    await gather_limited(started, wait, INFLIGHT)


async def drain(s: Any, on: bool) -> None:
    """The fixed tail; with export on, then until the export is quiet (bounded): nothing
    queued and the collector's count still for `QUIET_FOR_S` (longer than the child holds a
    span, ``OTEL_BSP_SCHEDULE_DELAY``, 1 s)."""
    await anyio.sleep(TAIL_S)
    if not on:
        return
    deadline = time.monotonic() + DRAIN_BOUND_S
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        stats = await s.export_stats()
        now = (stats.get("queued"), stats.get("exported"))
        if now != last or stats.get("queued") != 0:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= QUIET_FOR_S:
            return
        await anyio.sleep(QUIET_S)


#: ``--neighbour``: a process at nice 10 that spins 20 ms in every 200 (a tenth of a core,
#: about what the export child takes under this workload), doing nothing stepd does.
NEIGHBOUR = """
import os, time
os.nice(10)
while True:
    end = time.monotonic() + 0.02
    while time.monotonic() < end:
        pass
    time.sleep(0.18)
"""


async def one(tmp: Path, url: str | None, runs: int, sink_pid: int,
              recorder: Recorder | None, neighbour: bool = False) -> dict[str, Any]:
    async with _setups.embedded(tmp, concurrency=None, otlp_endpoint=url) as s:
        child = _otlp.export_child(os.getpid()) if url else None
        await warm_up(s)
        await anyio.sleep(SETTLE_S)
        await drain(s, url is not None)  # the warm-up's spans out before the window opens
        # before the window opens: a spawn, not a wait on the event loop
        busy = (subprocess.Popen([sys.executable, "-c", NEIGHBOUR])  # noqa: ASYNC220
                if neighbour else None)
        if busy is not None:
            child = busy.pid  # its CPU shows as the child's
        a = snapshot(child, sink_pid if url else None)
        if recorder is not None:
            recorder.start()
        t0 = time.perf_counter()
        await workload(s, runs)
        await drain(s, url is not None)
        wall = time.perf_counter() - t0
        counts = recorder.stop() if recorder is not None else None
        b = snapshot(child, sink_pid if url else None)
        if busy is not None:
            busy.kill()
            busy.wait()
        stats = await s.export_stats()
    steps = runs * STEPS
    label = "on" if url else ("busy" if neighbour else "off")
    row: dict[str, Any] = {"export": label, "runs": runs, "steps": steps,
                           "window_s": round(wall, 2)}
    if counts is None:
        for key in ("proc", "main", "main_wait", "export", "writer", "child", "sink", "gc"):
            row[f"{key}_ms"] = round((b[key] - a[key]) * 1000 / steps, 4)
        row["nivcsw"] = round((b["nivcsw"] - a["nivcsw"]) / steps, 3)
        for key in ("main_vcsw", "main_ivcsw", "export_vcsw", "writer_vcsw", "child_vcsw"):
            row[key] = round((b[key] - a[key]) / steps, 3)
        row["pipe_bytes"] = round((b["pipe"] - a["pipe"]) / steps, 1)
        for i in range(3):
            row[f"gc{i}_per_1k"] = round((b[f"gc{i}"] - a[f"gc{i}"]) * 1000 / steps, 2)
    else:
        main = counts["main"]
        row["main_calls"] = round((main["python"] + main["c"]) / steps, 1)
        row["main_python"] = round(main["python"] / steps, 1)
        for name, part in counts["threads"].items():
            key = "export" if name.startswith(EXPORT_THREAD) else (
                "writer" if name.startswith(WRITER_THREAD) else name)
            row[f"{key}_calls"] = round((part["python"] + part["c"]) / steps, 1)
    row["export_stats"] = stats
    return row


def start_sink() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "bench._otlp_sink"], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        proc.wait()
        raise SystemExit(f"otel_cost: the sink did not start: {line!r}")
    return proc, line.split("listening on", 1)[1].strip()


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians of off and of on (and busy), then the median of the pairs' differences (on -
    off, each pair from the same turn: what the load did to both is closest there)."""
    out = []
    variants = [v for v in ("off", "on", "busy") if any(r["export"] == v for r in rows)]
    for variant in variants:
        mine = [r for r in rows if r["export"] == variant]
        keys = [k for k, v in mine[0].items() if isinstance(v, (int, float))]
        out.append({"export": variant, "repeats": len(mine),
                    **{k: round(statistics.median(r[k] for r in mine if k in r), 4)
                       for k in keys}})
    by_turn: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_turn.setdefault(r["repeat"], {})[r["export"]] = r
    for other in variants[1:]:
        pairs = [(t["off"], t[other]) for t in by_turn.values()]
        keys = [k for k, v in pairs[0][1].items() if isinstance(v, (int, float))]
        out.append({"export": f"{other}-off", **{
            k: round(statistics.median(b.get(k, 0) - a.get(k, 0) for a, b in pairs), 4)
            for k in keys}})
    return out


def table(rows: list[dict[str, Any]], calls: bool) -> str:
    keys = (["main_calls", "main_python", "export_calls", "writer_calls"] if calls else
            ["proc_ms", "main_ms", "main_wait_ms", "gc_ms", "export_ms", "writer_ms", "child_ms",
             "sink_ms", "nivcsw", "main_vcsw", "main_ivcsw", "export_vcsw", "writer_vcsw",
             "child_vcsw", "pipe_bytes", "gc1_per_1k", "gc2_per_1k"])
    # Two rows of columns: one line of 18 columns is too wide to read.
    out = []
    for part in (keys[:9], keys[9:]):
        out.append(f"{'export':<7}" + "".join(f"{k:>13}" for k in part))
        for r in rows:
            out.append(f"{r['export']:<7}" + "".join(
                f"{r.get(k, 0):>13,.3f}" if not calls else f"{r.get(k, 0):>13,.1f}"
                for k in part))
        out.append("")
    return "\n".join(out).rstrip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=300, help="seq(3) runs per window")
    parser.add_argument("--repeat", type=int, default=3, help="off/on pairs, taking turns")
    parser.add_argument("--calls", action="store_true", help="count calls (cProfile), not CPU")
    parser.add_argument("--neighbour", action="store_true",
                        help="a third window per turn: export off, a process spinning a tenth "
                             "of a core at nice 10 beside it ('busy')")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the sink is stopped in finally
    recorder = None
    if args.calls:
        recorder = Recorder()
        recorder.install_thread_gate()  # before the daemon's threads start
    tmp = Path(tempfile.mkdtemp(prefix="stepd-otel-cost-"))
    sink, url = start_sink()
    rows: list[dict[str, Any]] = []
    try:
        for rep in range(args.repeat):
            # ABBA: off first in odd turns, on first in even ones (the first window of a
            # turn ran cheaper or dearer per step than the second, whichever it was).
            turn: list[tuple[str, str | None, bool]] = [("off", None, False), ("on", url, False)]
            if args.neighbour:
                turn.append(("busy", None, True))
            for name, variant, neighbour in (turn if rep % 2 == 0 else turn[::-1]):
                data = tmp / f"{rep}-{name}"
                row = anyio.run(one, data, variant, args.runs, sink.pid, recorder, neighbour)
                row["repeat"] = rep + 1
                row["commit"] = COMMIT
                row["loadavg"] = os.getloadavg()[0]
                print(json.dumps(row), flush=True)
                rows.append(row)
                shutil.rmtree(data, ignore_errors=True)
    finally:
        sink.terminate()
        sink.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    what = "calls per step (cProfile)" if args.calls else "per step (ms of CPU; counts)"
    print(f"embedded, {args.runs} x seq({STEPS}) per window, {args.repeat} off/on pairs, "
          f"medians, {what}:")
    print(table(medians(rows), args.calls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
