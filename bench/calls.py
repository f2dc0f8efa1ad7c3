"""``python -m bench.calls``: Python function calls per step, a deterministic cost counter.

    python -m bench.calls [--runs 10] [--steps 20] [--top 25] [--setups websocket,http,embedded]
                          [--update-budget] [--check-budget] [--keep]

PEERS.md's workload A, sequentially (one ``seq(20)`` run at a time, so that
batching does not blur it), counted with cProfile (bench/README.md, "Calls
per step"), in three setups with stepd's public SDK and its defaults:

* ``websocket``: ``stepd serve`` in its own process (its main thread, the
  event loop's, and separately its storage writer thread), ``stepd.Worker(url)``
  in a second process (default transport: the WebSocket; its main thread),
  ``stepd.AsyncClient(url)`` in this process (start -> result; main thread);
* ``http``: the same, the worker forced to HTTP long-poll
  (``stepd.Worker(url, transport="http")``);
* ``embedded``: ``stepd.embedded(path)``, a worker and the client on one
  event loop in this process: one count (main thread; the writer thread apart).

After the warm-up (3 x seq(1), 2 x seq(20)) and a settle (1.25 s), each process
opens a window (the children on SIGUSR1, acknowledged), N runs go one after
another, a tail (1.25 s) lets the last runs' deferred work happen inside the
window (the worker wakes once per step 1 s after the body started, to see
whether it needs heartbeats), and the windows close (SIGUSR2: the children
dump their counts). Then an idle window of the same
length is counted the same way; calls per step = (window - idle) / (N * 20).
"Calls" counts every profiler ``call`` event (a Python function called, or a
coroutine/generator resumed) and every ``c_call`` (a C function called from
Python): the headline is both together; the split is in the JSON lines.

Prints a table and one JSON line per figure (``"bench": "calls"``), then the
top functions of the daemon side by calls per step (``--top``).
``--update-budget`` writes bench/calls_budget.json; ``--check-budget`` exits 1
when a count is more than 20 % above it (tests/bench/test_calls_budget.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import anyio.to_thread

import stepd
from bench import _setups
from bench._calls_agent import Recorder
from bench._procs import STOP_WAIT_S, Child
from bench._workloads import SEQ, run_seq, warm_up

SETUPS = ("websocket", "http", "embedded")
BUDGET = Path(__file__).resolve().parent / "calls_budget.json"
TOLERANCE = 0.20
"""--check-budget and the test fail when a count is more than this above the budget."""
STEPS = 20
DEFERRED_S = 1.0
"""The longest a step's own work is deferred: the worker's heartbeat starter pops each
step's slot ``min(1 s, heartbeat_ms / 4)`` after its body started (stepd/_leases.py),
1 s with the default 10 s heartbeat, whether the body is over or not."""
SETTLE_S = DEFERRED_S + 0.25
"""Quiet after the warm-up, before the counted window: the warm-up's deferred work is done."""
GAP_S = 0.1
"""Between the counted window and the idle one (the tail already waited out the deferred work)."""
TAIL_S = DEFERRED_S + 0.25
"""After the last result, before the window closes: the last runs' deferred work
(the heartbeat slots above; lease and run actors stopping) falls inside the window."""
ACK_S = 15.0


def log(message: str) -> None:
    print(f"[calls {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- windows


class Window:
    """One counted window across this process (`Recorder`) and the children (signals)."""

    def __init__(self, local: Recorder, children: dict[str, Child]) -> None:
        self.local = local
        self.children = children

    async def count(self, body: Any) -> tuple[dict[str, dict[str, Any]], float]:
        """Counts per process (``{"daemon": ..., "worker": ..., "local": ...}``) while
        ``await body()`` runs, then the tail; and the local window's length in s."""
        for child in self.children.values():
            os.kill(child.pid, signal.SIGUSR1)
        for child in self.children.values():
            await anyio.to_thread.run_sync(child.wait_line, r"^calls: on", ACK_S)
        self.local.start()
        try:
            t0 = time.perf_counter()
            await body()
            await anyio.sleep(TAIL_S)
            wall = time.perf_counter() - t0
        finally:
            counts = {"local": self.local.stop()}
        for child in self.children.values():
            os.kill(child.pid, signal.SIGUSR2)
        for name, child in self.children.items():
            found = await anyio.to_thread.run_sync(child.wait_line, r"^calls: off (\S+)", ACK_S)
            counts[name] = json.loads(Path(found.group(1)).read_text())
        return counts, wall


async def measure(s: Any, window: Window, runs: int) -> dict[str, Any]:
    """Warm-up, then the counted window of `runs` x seq(20) and an idle window as long."""
    log(f"{s.transport}: warm-up (3 x seq(1), 2 x seq(20))")
    await warm_up(s)
    await anyio.sleep(SETTLE_S)

    async def workload() -> None:
        for _ in range(runs):
            await run_seq(s, STEPS)

    log(f"{s.transport}: counting {runs} x seq({STEPS})")
    busy, wall = await window.count(workload)
    await anyio.sleep(GAP_S)
    body_s = max(0.0, wall - TAIL_S)

    async def idle() -> None:
        await anyio.sleep(body_s)

    log(f"{s.transport}: counting an idle window of {wall:.2f} s")
    quiet, idle_wall = await window.count(idle)
    return {"busy": busy, "idle": quiet, "wall_s": wall, "idle_wall_s": idle_wall}


async def network_setup(transport: str, tmp: Path, runs: int) -> dict[str, Any]:
    dumps = tmp / f"{transport}-dumps"
    dumps.mkdir()
    agent = [sys.executable, "-m", "bench._calls_agent", str(dumps)]
    children: dict[str, Child] = {}
    client = None
    try:
        daemon = Child(f"daemon-{transport}", [*agent, "serve", "--data", str(tmp / f"{transport}-data"),
                                               "--host", "127.0.0.1", "--port", "0"], tmp)
        children["daemon"] = LIVE[daemon.pid] = daemon
        url = (await anyio.to_thread.run_sync(
            daemon.wait_line, r"stepd listening on (http://\S+) ", 30)).group(1)
        worker_cmd = [*agent, "worker", url] + (["--transport", "http"] if transport == "http" else [])
        worker = Child(f"worker-{transport}", worker_cmd, tmp)
        children["worker"] = LIVE[worker.pid] = worker
        found = await anyio.to_thread.run_sync(worker.wait_line, r"^ready (\S+)", 30)
        if found.group(1) != transport:
            raise SystemExit(f"calls: the worker connected over {found.group(1)}, not {transport}")
        client = stepd.AsyncClient(url, trust_env=False, timeout=60)
        s = SimpleNamespace(transport=transport, client=client)
        result = await measure(s, Window(LOCAL, children), runs)
        for name, child in children.items():
            if not child.alive():
                raise SystemExit(f"calls: the {name} died:\n{child.stderr_tail()}")
        for part in ("busy", "idle"):
            result[part]["client"] = result[part].pop("local")
        return result
    finally:
        if client is not None:
            await client.aclose()
        with anyio.CancelScope(shield=True):
            for child in reversed(list(children.values())):  # worker first, then the daemon
                await anyio.to_thread.run_sync(child.stop)
                LIVE.pop(child.pid, None)


async def embedded_setup(tmp: Path, runs: int) -> dict[str, Any]:
    # The worker as a user writes it, `stepd.Worker(client)`: the SDK's default concurrency.
    async with _setups.embedded(tmp / "embedded-data", concurrency=None) as s:
        result = await measure(s, Window(LOCAL, {}), runs)
    for part in ("busy", "idle"):
        result[part]["process"] = result[part].pop("local")
    return result


LOCAL = Recorder()
LIVE: dict[int, Child] = {}
"""The daemon and worker processes running now (stopped by PID on SIGTERM/SIGINT too)."""


def on_stop_signal(tmp: Path, keep: bool) -> Any:
    """A SIGTERM/SIGINT handler: stop the children by PID (SIGTERM, a bounded wait, SIGKILL,
    reaped), remove the temp dir, exit 128 + signal. (The children also get SIGTERM
    from the kernel if this process dies without it: ``_calls_agent.die_with_parent``.)"""

    def handler(signum: int, _frame: Any) -> None:
        for child in reversed(list(LIVE.values())):  # the worker first, then the daemon
            try:
                os.kill(child.pid, signal.SIGTERM)
                child.proc.wait(STOP_WAIT_S)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"calls: stopped by signal {signum}", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    return handler


def run_setup(setup: str, tmp: Path, runs: int) -> dict[str, Any]:
    fn = embedded_setup(tmp, runs) if setup == "embedded" else network_setup(setup, tmp, runs)

    async def go() -> dict[str, Any]:
        return await fn

    return anyio.run(go, backend="asyncio", backend_options={"use_uvloop": True})


# --------------------------------------------------------------------------- figures


WRITER = "stepd-storage-writer"


def _all_threads(part: dict[str, Any]) -> int:
    return int(part["main"]["python"] + part["main"]["c"]
               + sum(t["python"] + t["c"] for t in part["threads"].values()))


def figures(setup: str, raw: dict[str, Any], runs: int) -> list[dict[str, Any]]:
    """One row per (process, thread): calls per step, window minus idle."""
    steps = runs * STEPS
    rows = []
    empty = {"python": 0, "c": 0, "functions": {}, "areas": {}}
    for process, busy in raw["busy"].items():
        idle = raw["idle"][process]
        parts = [("main", busy["main"], idle["main"])]
        if WRITER in busy["threads"] or WRITER in idle["threads"]:
            parts.append(("writer", busy["threads"].get(WRITER, empty),
                          idle["threads"].get(WRITER, empty)))
        for thread, b, i in parts:
            total_b, total_i = b["python"] + b["c"], i["python"] + i["c"]
            row = {
                "bench": "calls", "setup": setup, "process": process, "thread": thread,
                "calls_per_step": round((total_b - total_i) / steps, 1),
                "python_calls_per_step": round((b["python"] - i["python"]) / steps, 1),
                "c_calls_per_step": round((b["c"] - i["c"]) / steps, 1),
                "window_calls": total_b, "idle_calls": total_i,
                "idle_calls_per_step": round(total_i / steps, 2),
                "idle_share_pct": round(100 * total_i / total_b, 2) if total_b else 0.0,
            }
            if thread == "main":
                row["all_threads_calls_per_step"] = round(
                    (_all_threads(busy) - _all_threads(idle)) / steps, 1)
                row["other_threads"] = sorted(set(busy["threads"]) - {WRITER})
                keys = set(b["areas"]) | set(i["areas"])
                net = {k: round((b["areas"].get(k, 0) - i["areas"].get(k, 0)) / steps, 1)
                       for k in keys}
                row["areas_per_step"] = dict(sorted(net.items(), key=lambda kv: -kv[1]))
            row.update({"runs": runs, "steps": steps, "window_s": round(raw["wall_s"], 3),
                        "idle_window_s": round(raw["idle_wall_s"], 3)})
            rows.append(row)
        if len(parts) == 2:  # the storage's batches: on the writer thread or, idle, on the loop
            main_row, writer_row = rows[-2], rows[-1]
            rows.append({
                "bench": "calls", "setup": setup, "process": process, "thread": MAIN_WRITER,
                "calls_per_step": round(main_row["calls_per_step"]
                                        + writer_row["calls_per_step"], 1),
                "python_calls_per_step": round(main_row["python_calls_per_step"]
                                               + writer_row["python_calls_per_step"], 1),
                "c_calls_per_step": round(main_row["c_calls_per_step"]
                                          + writer_row["c_calls_per_step"], 1),
                "idle_calls_per_step": round(main_row["idle_calls_per_step"]
                                             + writer_row["idle_calls_per_step"], 2),
                "idle_share_pct": main_row["idle_share_pct"],
                "runs": runs, "steps": steps,
            })
    return rows


MAIN_WRITER = "main+writer"
"""The row that sums a process's main and storage-writer threads: a storage batch runs on
the writer thread, or on the event loop's (the main) thread while the writer idles and
commits are quick (docs/storage.md "On the loop while the writer is idle"), which moves
its calls between the two rows with the machine's disk and load, not with the code. The
budget holds this sum for a process with a writer, and the main thread for the others."""


def budgeted(row: dict[str, Any], rows: list[dict[str, Any]]) -> bool:
    """Whether the budget holds `row`: `MAIN_WRITER` where there is one, else ``main``."""
    if row["thread"] == MAIN_WRITER:
        return True
    if row["thread"] != "main":
        return False
    return not any(r["thread"] == MAIN_WRITER and r["setup"] == row["setup"]
                   and r["process"] == row["process"] for r in rows)


def top_functions(process: str, raw: dict[str, Any], runs: int, n: int, python_only: bool = False
                  ) -> list[tuple[str, float, str]]:
    """The main thread's functions by calls per step (window minus idle), most first."""
    busy = raw["busy"][process]["main"]["functions"]
    idle = raw["idle"][process]["main"]["functions"]
    steps = runs * STEPS
    net = [(label, (count - idle.get(label, [0])[0]) / steps, "C" if is_c else "py")
           for label, (count, is_c) in busy.items() if not (python_only and is_c)]
    net.sort(key=lambda x: (-x[1], x[0]))
    return net[:n]


def key_of(row: dict[str, Any]) -> str:
    return f"{row['setup']}/{row['process']}/{row['thread']}"


def budget_counts(rows: list[dict[str, Any]]) -> dict[str, float]:
    return {key_of(r): r["calls_per_step"] for r in rows if budgeted(r, rows)}


def over_budget(rows: list[dict[str, Any]], budget: dict[str, Any],
                tolerance: float = TOLERANCE) -> list[str]:
    """What rose more than `tolerance` above the budget (missing figures too)."""
    limits = budget["calls_per_step"]
    got = budget_counts(rows)
    problems = []
    for key, limit in limits.items():
        if key not in got:
            problems.append(f"{key}: not measured")
        elif got[key] > limit * (1 + tolerance):
            problems.append(f"{key}: {got[key]:,.1f} calls per step, budget {limit:,.1f} "
                            f"(+{(got[key] / limit - 1) * 100:.0f} %, more than "
                            f"+{tolerance * 100:.0f} %)")
    return problems


def git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=BUDGET.parent.parent, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_budget(rows: list[dict[str, Any]], runs: int) -> None:
    body = {
        "what": "Python function calls per step (cProfile call + c_call events, coroutine "
                "resumes included; window minus an idle window of the same length) on "
                "sequential workload A: python -m bench.calls (bench/README.md)",
        "commit": git("rev-parse", "HEAD"),
        "worktree_dirty": git("status", "--porcelain", "--untracked-files=no") != "",
        "date": datetime.date.today().isoformat(),
        "python": sys.version.split()[0],
        "runs": runs,
        "tolerance": TOLERANCE,
        "calls_per_step": budget_counts(rows),
    }
    BUDGET.write_text(json.dumps(body, indent=2) + "\n")
    log(f"wrote {BUDGET}")


# --------------------------------------------------------------------------- main


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'setup':<10} {'process':<8} {'thread':<11} {'calls/step':>10} {'python':>8} "
            f"{'C':>7} {'idle/step':>9} {'idle %':>7} {'all threads':>11}")
    lines = [head]
    for r in rows:
        every = r.get("all_threads_calls_per_step")
        lines.append(f"{r['setup']:<10} {r['process']:<8} {r['thread']:<11} "
                     f"{r['calls_per_step']:>10,.1f} {r['python_calls_per_step']:>8,.1f} "
                     f"{r['c_calls_per_step']:>7,.1f} {r['idle_calls_per_step']:>9,.2f} "
                     f"{r['idle_share_pct']:>6.2f}%"
                     + (f" {every:>11,.1f}" if every is not None else ""))
    return "\n".join(lines)


def areas_table(rows: list[dict[str, Any]], limit: int = 12) -> str:
    mains = [r for r in rows if r["thread"] == "main" and r["process"] != "client"]
    totals: dict[str, float] = {}
    for r in mains:
        for k, v in r["areas_per_step"].items():
            totals[k] = totals.get(k, 0.0) + abs(v)
    names = sorted(totals, key=lambda k: -totals[k])
    shown, rest = names[:limit], names[limit:]
    heads = [f"{r['setup'][:4]} {r['process']}" for r in mains]
    lines = [f"{'':<20}" + "".join(f"{h:>15}" for h in heads)]
    for k in shown:
        lines.append(f"{k:<20}" + "".join(f"{r['areas_per_step'].get(k, 0.0):>15,.1f}"
                                          for r in mains))
    if rest:
        lines.append(f"{'(the rest)':<20}" + "".join(
            f"{sum(r['areas_per_step'].get(k, 0.0) for k in rest):>15,.1f}" for r in mains))
    lines.append(f"{'total':<20}" + "".join(f"{r['calls_per_step']:>15,.1f}" for r in mains))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    global STEPS  # one run of the tool counts one shape of run
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="seq(20) runs counted per setup")
    parser.add_argument("--steps", type=int, default=STEPS, choices=sorted(SEQ),
                        help="count seq(N) runs (1: what a run costs beyond its steps: the "
                             "start, the result, the run's own end); figures stay per step")
    parser.add_argument("--top", type=int, default=25,
                        help="top functions of the daemon side by calls per step (0: none)")
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--update-budget", action="store_true", help=f"write {BUDGET.name}")
    parser.add_argument("--check-budget", action="store_true",
                        help=f"exit 1 when a count is > {TOLERANCE * 100:.0f}%% above {BUDGET.name}")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs, dumps)")
    args = parser.parse_args(argv)
    setups = [x for x in args.setups.split(",") if x]
    for x in setups:
        if x not in SETUPS:
            parser.error(f"unknown setup {x!r}; expected {', '.join(SETUPS)}")
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if args.update_budget and set(setups) != set(SETUPS):
        parser.error("--update-budget measures every setup")
    if args.steps != STEPS and (args.update_budget or args.check_budget):
        parser.error(f"the budget is of seq({STEPS}) runs; leave --steps at {STEPS}")
    STEPS = args.steps

    t0 = time.perf_counter()
    LOCAL.install_thread_gate()  # before the embedded daemon starts its writer thread
    tmp = Path(tempfile.mkdtemp(prefix="stepd-bench-calls-"))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_stop_signal(tmp, args.keep))
    rows: list[dict[str, Any]] = []
    tops: list[dict[str, Any]] = []
    try:
        for setup in setups:
            raw = run_setup(setup, tmp, args.runs)
            got = figures(setup, raw, args.runs)
            rows += got
            for r in got:
                print(json.dumps(r), flush=True)
            if args.top:
                side = "process" if setup == "embedded" else "daemon"
                row = {"bench": "calls", "setup": setup, "process": side, "thread": "main"}
                for key, python_only in (("top", False), ("top_python", True)):
                    top = top_functions(side, raw, args.runs, args.top, python_only)
                    row[key] = [[label, round(n, 2), kind] for label, n, kind in top]
                tops.append(row)
                print(json.dumps(row), flush=True)
    finally:
        if args.keep:
            log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    print()
    print(f"Calls per step (cProfile call + c_call events; window minus an idle window of the "
          f"same length), {args.runs} x seq({STEPS}) one at a time, per setup:")
    print(table(rows))
    print()
    print("Where the main threads' calls go, per step (a Python function counts in the "
          "package it is in; a C function in the package of the code calling it):")
    print(areas_table(rows))
    for row in tops:
        for key, what in (("top", "functions"), ("top_python", "Python functions")):
            print()
            print(f"top {len(row[key])} {what}, {row['setup']} {row['process']} main thread, "
                  "calls per step:")
            for label, n, kind in row[key]:
                print(f"  {n:>8,.2f}  {kind:<2}  {label}")
    code = 0
    if args.update_budget:
        write_budget(rows, args.runs)
    if args.check_budget:
        problems = over_budget(rows, json.loads(BUDGET.read_text()))
        for p in problems:
            print(f"OVER BUDGET: {p}")
        code = 1 if problems else 0
        if not problems:
            print(f"within budget (+{TOLERANCE:.0%}): {BUDGET.name}")
    print(f"took {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
