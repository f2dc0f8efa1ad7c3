"""``python -m bench``: PEERS.md's workloads against stepd, on three transports.

    python -m bench [--quick] [--only A,B,C,D,durability,E,F,G]
                    [--transport embedded,websocket,http] [--out FILE]

Workloads (bench/README.md says exactly what each measures):

* A  sequential latency: 20 runs of seq(20), then 20 of seq(1), one at a time;
* B  throughput: 1000 runs of seq(3), at most 100 starts then 100 waits in flight;
* C  idle cost: CPU% of daemon and worker over 30 s, 5 s after warm-up;
* D  memory: peak RSS of daemon, worker and client during B (every 50 ms);
* durability: fsync-family calls per extra step (strace on the daemon), beside
  the storage's own commit counter;
* E  timers: 100,000 runs asleep in a durable timer, woken at one moment;
* F  leases: 1,000 leases held 60 s, heartbeating every 1 s (TTL 3 s);
* G  sticky execution: a 50-step workflow whose state grows 2 KB per step, the
  worker's sticky cache off then on (bytes per lease, daemon CPU per step,
  identical results; network transports only; not in the default set).

Prints one JSON line per workload and transport (PEERS.md's field names),
then a table beside the PEERS.md anchors and stepd's targets. Exit status 1
when a result is wrong or lost, or a guarantee is broken (a commit not
synced, a spurious lease expiry).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

import stepd
from bench import _otlp, _setups
from bench._procs import PIDS_ENV, kill_pid
from bench._table import render
from bench._workloads import (
    BenchFailure,
    warm_up,
    workload_a,
    workload_b,
    workload_c,
    workload_durability,
    workload_e,
    workload_f,
)
from bench.engine import synced_commit_baseline
from bench.sticky import workload_g

TRANSPORTS = ("embedded", "websocket", "http")
F_WORKERS = 4
"""F over the network: the leases are spread over this many worker processes (--f-workers)."""
WORKLOADS = ("A", "B", "C", "D", "durability", "E", "F")
EXTRA_WORKLOADS = ("G",)  # run only when named in --only

FULL = {"a_runs": 20, "a_one": 20, "b_wf": 1000, "c_settle": 5.0, "c_window": 30.0,
        "dur_runs": 20, "e_runs": 100_000, "e_margin": 2.0, "e_probe": 1000,
        "f_leases": 1000, "f_hold": 60.0, "g_runs": 10}
QUICK = {"a_runs": 10, "a_one": 10, "b_wf": 300, "c_settle": 0.5, "c_window": 1.5,
         "dur_runs": 3, "e_runs": 10_000, "e_margin": 0.5, "e_probe": 200,
         "f_leases": 200, "f_hold": 10.0, "g_runs": 2}


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Output:
    def __init__(self, out: Path | None, quick: bool, daemon_args: Sequence[str] = (),
                 embedded_gc: str = "default", client_loop: str = "asyncio") -> None:
        self.lock = threading.Lock()
        self.rows: list[dict[str, Any]] = []
        self.quick = quick
        self.daemon_args = list(daemon_args)
        self.embedded_gc = embedded_gc
        self.client_loop = client_loop
        self.file = out.open("w") if out is not None else None

    def emit(self, transport: str | None, workload: str, fields: dict[str, Any]) -> None:
        row: dict[str, Any] = {"engine": "stepd"}
        if transport is not None:
            row["transport"] = transport
        row["workload"] = workload
        row.update(fields)
        if self.quick:
            row["quick"] = True
        if self.daemon_args and transport not in (None, "embedded"):
            row["daemon_args"] = self.daemon_args
        if transport == "embedded" and self.embedded_gc != "default":
            row["gc"] = self.embedded_gc
        if transport is not None and self.client_loop != "asyncio":
            row["client_loop"] = self.client_loop
        self.add(row)

    def add(self, row: dict[str, Any]) -> None:
        """A row (this process's, or one a child process emitted)."""
        line = json.dumps(row)
        with self.lock:
            self.rows.append(row)
            print(line, flush=True)
            if self.file is not None:
                self.file.write(line + "\n")
                self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


async def main_workloads(transport: str, only: set[str], p: dict[str, Any], tmp: Path,
                         out: Output) -> None:
    """A, B+D, C, durability on one daemon + worker (fresh data directory)."""
    data = tmp / f"{transport}-main"
    endpoint = p.get("otlp_endpoint")
    conc = p["worker_concurrency"]
    if transport == "embedded":
        setup_cm = _setups.embedded(data, concurrency=conc, otlp_endpoint=endpoint)
    else:
        extra = [] if endpoint is None else ["--otlp-endpoint", endpoint]
        setup_cm = _setups.network(transport, data, tmp, concurrency=conc,
                                   daemon_args=[*p["daemon_args"], *extra])
    async with setup_cm as s:
        log(f"{transport}: warm-up (3 x seq(1), 2 x seq(20))")
        await warm_up(s)
        if "C" in only:
            log(f"{transport}: C idle, {p['c_settle']:g} s settle + {p['c_window']:g} s window")
            out.emit(transport, "C", await workload_c(s, p["c_settle"], p["c_window"]))
        if "A" in only:
            log(f"{transport}: A ({p['a_runs']} x seq(20), {p['a_one']} x seq(1))")
            out.emit(transport, "A", await workload_a(s, p["a_runs"], p["a_one"]))
        if "B" in only or "D" in only:
            log(f"{transport}: B ({p['b_wf']} x seq(3)) with D sampling RSS")
            b, d = await workload_b(s, p["b_wf"], 3)
            if endpoint is not None:
                b["otlp_export"] = await s.export_stats()  # dropped: spans lost to a full queue
            if "B" in only:
                out.emit(transport, "B", b)
            if "D" in only:
                out.emit(transport, "D", d)
        if "durability" in only:
            log(f"{transport}: durability (strace; {p['dur_runs']} x seq(1), then x seq(20))")
            fields = await workload_durability(s, p["dur_runs"], tmp)
            out.emit(transport, "durability", fields)
            if fields.get("every_commit_synced") is False:
                raise BenchFailure("a storage commit without its fsync-family call: "
                                   f"{fields['phase_1step']} / {fields['phase_20step']}")


async def timers_workload(transport: str, p: dict[str, Any], tmp: Path, out: Output) -> None:
    data = tmp / f"{transport}-timers"
    setup_cm = (_setups.embedded(data, worker=False) if transport == "embedded"
                else _setups.network(transport, data, tmp, workers=0, tag="-E",
                                     daemon_args=p["daemon_args"]))
    async with setup_cm as s:
        log(f"{transport}: E ({p['e_runs']:,} sleeping runs)")
        fields = await workload_e(s, p["e_runs"], p["e_margin"], p["e_probe"])
        if transport != "embedded":
            fields["note"] = ("sleep-only workflow: no worker takes part; the client starts runs "
                              "over HTTP whichever the worker transport")
        out.emit(transport, "E", fields)


async def leases_workload(transport: str, p: dict[str, Any], tmp: Path, out: Output,
                          f_workers: int) -> None:
    data = tmp / f"{transport}-leases"
    n = p["f_leases"]
    if transport == "embedded":
        setup_cm = _setups.embedded(data, concurrency=n, lease_ttl_ms=3000, heartbeat_ms=1000)
    else:
        setup_cm = _setups.network(transport, data, tmp, concurrency=-(-n // f_workers),
                                   workers=f_workers, tag="-F",
                                   daemon_args=["--lease-ttl-ms", "3000", "--heartbeat-ms", "1000",
                                                *p["daemon_args"]])
    async with setup_cm as s:
        log(f"{transport}: F ({n} leases held {p['f_hold']:.0f} s, heartbeat 1 s, TTL 3 s)")
        fields = await workload_f(s, n, p["f_hold"], concurrent=out.quick)
        out.emit(transport, "F", fields)
        if not fields["ok"]:
            log(f"{transport}: F NOT MET: {fields['journal_events']}, "
                f"{fields['unfinished_after_hold_plus_30s']} runs unfinished, "
                f"at most {fields['max_live_before_window']} of {n} leases live")


def plan(transports: list[str], only: set[str], quick: bool) -> list[tuple[str, str]]:
    """(transport, section) in order; a section is one child process."""
    out = []
    e_network_done = False
    for t in transports:
        if only & {"A", "B", "C", "D", "durability"}:
            out.append((t, "main"))
        if "E" in only:
            # E has no worker: over websocket and http it is the same daemon and the same
            # client, so it runs once on the network (and once embedded, except --quick).
            network = t != "embedded"
            if (network and not e_network_done) or (not network and not quick):
                out.append((t, "E"))
                e_network_done |= network
        if "F" in only:
            out.append((t, "F"))
        if "G" in only and t != "embedded":
            out.append((t, "G"))
    if quick and "E" in only and not any(sec == "E" for _, sec in out) and transports:
        out.append((transports[0], "E"))  # --quick with only embedded
    return out


async def run_section(section: str, transport: str, only: set[str], p: dict[str, Any],
                      tmp: Path, out: Output, f_workers: int) -> None:
    if section == "main":
        await main_workloads(transport, only, p, tmp, out)
    elif section == "E":
        await timers_workload(transport, p, tmp, out)
    elif section == "F":
        await leases_workload(transport, p, tmp, out, f_workers)
    elif section == "G":
        log(f"{transport}: G (sticky off, then on: {p['g_runs']} x 50 steps, +2 KB state/step)")
        fields = await workload_g(transport, tmp, p["g_runs"], 50)
        out.emit(transport, "G", fields)
        if not fields["results_identical"]:
            raise BenchFailure("G: the results with the sticky cache on differ from off")
    else:  # pragma: no cover
        raise ValueError(section)


def interruptible() -> None:
    """SIGINT raises KeyboardInterrupt (even if our parent ignored it) and SIGTERM acts as SIGINT.

    In a child, asyncio's runner then cancels the section, whose cleanup stops its daemon
    and workers by PID; in the parent, `run_child` hands the interrupt to its child.
    """
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGINT))


def child_main(args: argparse.Namespace, only: set[str]) -> None:
    """One section in this (fresh) process: its JSON lines on stdout, exit 1 on failure.

    The process is the client (and, embedded, the whole host) as a user writes it:
    ``asyncio.run`` (plain asyncio; ``--client-loop uvloop`` for uvloop), the process's
    GC as CPython leaves it (``--embedded-gc tuned``: `stepd.tune_gc` first).
    """
    interruptible()
    p = dict(QUICK if args.quick else FULL, daemon_args=args.daemon_arg,
             otlp_endpoint=args.otlp_endpoint, worker_concurrency=args.worker_concurrency)
    p.update(json.loads(args.params) if args.params else {})
    out = Output(None, args.quick, args.daemon_arg, args.embedded_gc, args.client_loop)
    if args.transport == "embedded" and args.embedded_gc == "tuned":
        stepd.tune_gc()  # what an embedding application may choose to do (docs/serve.md)
    try:
        anyio.run(run_section, args.child, args.transport, only, p, Path(args.tmp), out,
                  args.f_workers, backend="asyncio",
                  backend_options={"use_uvloop": args.client_loop == "uvloop"})
    except BenchFailure as exc:
        out.emit(args.transport, "failure", {"section": args.child, "message": str(exc)})
        sys.exit(1)
    except (KeyboardInterrupt, asyncio.CancelledError):
        out.emit(args.transport, "failure", {"section": args.child, "message": "interrupted"})
        sys.exit(1)
    except BaseException as exc:  # noqa: BLE001 - a crash: report it, run the other sections
        log(f"ERROR {args.transport} {args.child}:\n{traceback.format_exc()}")
        out.emit(args.transport, "failure", {"section": args.child, "message": repr(exc)})
        sys.exit(1)


SECTION_TIMEOUT_S = {"main": 600, "E": 900, "F": 400, "G": 600}


def run_child(section: str, transport: str, args: argparse.Namespace, only: set[str],
              tmp: Path, out: Output, tag: dict[str, Any] | None = None,
              extra: Sequence[str] = (), prefix: Sequence[str] = (),
              params: dict[str, Any] | None = None) -> list[str]:
    """Run one section in a child process; its rows go to `out` (with `tag` added);
    returns its failures. ``extra``: more of its arguments; ``prefix`` runs it under
    another command (``ip netns exec NS``, which execs: the PID stays the child's);
    ``params`` overrides workload sizes."""
    cmd = [*prefix, sys.executable, "-m", "bench", "--child", section, "--transport", transport,
           "--only", ",".join(sorted(only)), "--tmp", str(tmp), "--f-workers", str(args.f_workers),
           *extra]
    if args.quick:
        cmd.append("--quick")
    cmd += [f"--daemon-arg={a}" for a in args.daemon_arg]
    cmd += ["--embedded-gc", args.embedded_gc, "--client-loop", args.client_loop]
    if args.worker_concurrency is not None:
        cmd += ["--worker-concurrency", str(args.worker_concurrency)]
    if params:
        cmd += ["--params", json.dumps(params)]
    env = dict(os.environ, **{PIDS_ENV: str(tmp / "pids")})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    failures: list[str] = []
    deadline = time.monotonic() + SECTION_TIMEOUT_S[section]

    def watchdog() -> None:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                log(f"{transport} {section}: over {SECTION_TIMEOUT_S[section]} s: SIGINT")
                failures.append(f"{transport} {section}: timed out")
                proc.send_signal(signal.SIGINT)  # the child cancels its task: cleanup runs
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                return
            time.sleep(0.5)

    threading.Thread(target=watchdog, daemon=True).start()
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            if not line.startswith("{"):
                print(line, end="", file=sys.stderr)
                continue
            row = json.loads(line)
            if row.get("workload") == "failure":
                failures.append(f"{transport} {row.get('section')}: {row.get('message')}")
            else:
                out.add({**row, **(tag or {})})
    finally:
        if proc.poll() is None:  # we are being interrupted: let the child clean up, bounded
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    code = proc.wait()
    if code != 0 and not failures:
        failures.append(f"{transport} {section}: exited {code}")
    return failures


def median_of_repeats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from N runs of a workload: each number (and each number in a dict of
    numbers, such as ``cpu_s``) is the median of its N values; ``per_repeat`` keeps them."""
    out: dict[str, Any] = {"repeats": len(rows), "per_repeat": {}}
    skip = {"engine", "transport", "workload", "repeat", "quick"}
    for key, first in rows[0].items():
        if key in skip:
            continue
        values = [r.get(key) for r in rows]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            median = statistics.median(values)
            integral = all(isinstance(v, int) for v in values) and median == int(median)
            out[key] = int(median) if integral else round(median, 3)
            out["per_repeat"][key] = values
        elif all(isinstance(v, dict) for v in values) and all(
                isinstance(x, (int, float)) and not isinstance(x, bool)
                for v in values for x in v.values()):
            keys = set().union(*(v.keys() for v in values))
            out[key] = {k: round(statistics.median(v[k] for v in values if k in v), 3)
                        for k in sorted(keys)}
        else:
            out[key] = first
    return out


def reap_leftovers(tmp: Path) -> None:
    """Stop any daemon/worker/strace a crashed child left behind (by PID, ours only)."""
    path = tmp / "pids"
    if not path.exists():
        return
    mark = f"{PIDS_ENV}={path}".encode()
    for pid in {int(x) for x in path.read_text().split()}:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue  # gone
        if mark not in environ.split(b"\0"):
            continue  # not ours (the PID was reused)
        log(f"stopping leftover pid {pid}")
        kill_pid(pid)


def clean_up(tmp: Path, keep: bool) -> None:
    """After a run: stop what a child left behind, then remove the temp dir (unless kept)."""
    reap_leftovers(tmp)
    if keep:
        log(f"kept {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:  # pragma: no cover
        pass
    try:
        mem = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    except (OSError, ValueError, IndexError):  # pragma: no cover
        mem = 0
    return {"cpus": os.cpu_count(), "cpu_model": model, "mem_gib": round(mem / 2**30, 1),
            "python": platform.python_version(), "kernel": platform.release()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="under a minute: fewer runs, 3 s idle window, E 10,000, F 200 x 10 s")
    parser.add_argument("--only", default=",".join(WORKLOADS),
                        help=f"workloads, comma-separated ({','.join(WORKLOADS)}; and G, "
                             "sticky execution, only when named)")
    parser.add_argument("--transport", default=",".join(TRANSPORTS),
                        help=f"transports, comma-separated ({','.join(TRANSPORTS)})")
    parser.add_argument("--out", type=Path, help="also write the JSON lines to this file")
    parser.add_argument("--f-workers", type=int, default=F_WORKERS,
                        help=f"F over the network: worker processes sharing the leases ({F_WORKERS})")
    parser.add_argument("--child", choices=["main", "E", "F", "G"], help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    parser.add_argument("--params", help=argparse.SUPPRESS)
    parser.add_argument("--repeat", type=int, default=1,
                        help="run A-D this many times per transport (taking turns, each on a "
                             "fresh daemon) and report the median of the per-run figures")
    parser.add_argument("--daemon-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for `stepd serve` (repeatable; e.g. "
                             "--daemon-arg=--gc --daemon-arg=default); recorded in the rows")
    parser.add_argument("--embedded-gc", choices=["default", "tuned"], default="default",
                        help="embedded: leave the process's GC as stepd.embedded leaves it "
                             "(default) or call stepd.tune_gc() first; recorded in the rows")
    parser.add_argument("--client-loop", choices=["asyncio", "uvloop"], default="asyncio",
                        help="the client's (and the embedded host's) event loop: asyncio as "
                             "asyncio.run gives it (default, what a user writes), or uvloop")
    parser.add_argument("--worker-concurrency", type=int, default=None, metavar="N",
                        help="the worker's slots in A-D (default: stepd.Worker's own default)")
    parser.add_argument("--tuned", action="store_true",
                        help="the knobs bench used before issue 16: client on uvloop, worker "
                             "concurrency 128, embedded host with stepd.tune_gc()")
    parser.add_argument("--otlp", action="store_true",
                        help="run each A-D section twice, OpenTelemetry export off and on "
                             "(to a local OTLP/HTTP sink, bench._otlp_sink), taking turns; "
                             "rows carry \"otlp\": off|on; the table compares B")
    parser.add_argument("--otlp-endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--keep", action="store_true",
                        help="keep the temporary directory (data, daemon and worker logs)")
    vs = parser.add_argument_group("--vs-restate: Restate and stepd side by side, in cycles")
    vs.add_argument("--vs-restate", action="store_true",
                    help="each cycle: Restate (../shared/bench/peers/run-restate.sh), then stepd "
                         "on websocket, http, embedded; A-D; per-cycle ratios and their medians")
    vs.add_argument("--cycles", type=int, default=3, help="--vs-restate cycles (3)")
    vs.add_argument("--a-runs", type=int, default=20, help="A: runs of seq(20) and of seq(1) (20)")
    vs.add_argument("--b-count", type=int, default=1000, help="B: workflows of seq(3) (1000)")
    vs.add_argument("--idle-seconds", type=float, default=30.0, help="C: the idle window (30)")
    vs.add_argument("--settle", type=float, default=5.0, help="C: the settle before it (5)")
    vs.add_argument("--peers-dir", type=Path, default=None,
                    help="the peers' folder (default: ../shared/bench/peers from the repo)")
    vs.add_argument("--netns", default=None,
                    help="use this network namespace (made by you) instead of making one")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, set[str], list[str]]:
    """The arguments, the workloads and the transports; argparse exits on a bad one."""
    parser = build_parser()
    args = parser.parse_args(argv)
    only = {w.strip() for w in args.only.split(",") if w.strip()}
    only = {"durability" if w.lower() in ("durability", "dur") else w.upper() for w in only}
    transports = [t.strip() for t in args.transport.split(",") if t.strip()]
    for w in only:
        if w not in WORKLOADS + EXTRA_WORKLOADS:
            parser.error(f"unknown workload {w!r}; expected "
                         f"{', '.join(WORKLOADS + EXTRA_WORKLOADS)}")
    for t in transports:
        if t not in TRANSPORTS:
            parser.error(f"unknown transport {t!r}; expected {', '.join(TRANSPORTS)}")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.cycles < 1:
        parser.error("--cycles must be at least 1")
    if args.worker_concurrency is not None and args.worker_concurrency < 1:
        parser.error("--worker-concurrency must be at least 1")
    if args.a_runs < 1 or args.b_count < 1 or args.idle_seconds <= 0 or args.settle < 0:
        parser.error("--a-runs and --b-count must be at least 1, --idle-seconds above 0")
    if args.tuned:
        args.client_loop = "uvloop"
        args.embedded_gc = "tuned"
        if args.worker_concurrency is None:
            args.worker_concurrency = 128
    return args, only, transports


def main() -> None:
    args, only, transports = parse_args()
    if args.child:
        child_main(args, only)
        return
    if args.vs_restate:
        from bench._vs_restate import run_vs_restate

        interruptible()
        sys.exit(run_vs_restate(args, transports))
    interruptible()
    out = Output(args.out, args.quick, args.daemon_arg, args.embedded_gc, args.client_loop)
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="stepd-bench-"))
    failures: list[str] = []
    try:
        base = synced_commit_baseline(tmp / "baseline")
        out.emit(None, "baseline", {"synced_lmdb_commit_ms_median": round(base * 1000, 3),
                                    "what": "one synced LMDB commit of a ~200-byte record, "
                                            "median of 500, same disk, same run"})
        out.emit(None, "machine", machine())
        sections = plan(transports, only, args.quick)
        parallel = [ts for ts in sections if args.quick and ts[1] == "F"]
        if args.repeat > 1 or args.otlp:
            # The A-D section N times, the transports (and with --otlp, export off and on)
            # taking turns, then the rest once.
            mains = [ts for ts in sections if ts[1] == "main"]
            with _otlp.sink_for(args.otlp) as sink:
                for rep in range(1, args.repeat + 1):
                    for transport, section in mains:
                        for variant, extra in _otlp.variants(sink):
                            log(f"repeat {rep}/{args.repeat}: {transport}"
                                + (f", export {variant}" if variant else ""))
                            tag = {"repeat": rep, **({"otlp": variant} if variant else {})}
                            try:
                                failures += run_child(section, transport, args, only, tmp, out,
                                                      tag, extra)
                            finally:
                                reap_leftovers(tmp)
                if sink is not None:
                    out.emit(None, "otlp_sink", {"spans": sink.span_count,
                                                 "requests": sink.requests})
            for transport, _ in mains:
                for variant, _extra in _otlp.variants(sink):
                    for workload in ("A", "B", "C", "D"):
                        reps = [r for r in out.rows if r.get("transport") == transport
                                and r.get("workload") == workload and "repeat" in r
                                and r.get("otlp") == variant]
                        if reps:
                            row = median_of_repeats(reps)
                            out.emit(transport, workload,
                                     {**row, "otlp": variant} if variant else row)
            sections = [ts for ts in sections if ts[1] != "main"]
        for transport, section in [ts for ts in sections if ts not in parallel]:
            try:
                failures += run_child(section, transport, args, only, tmp, out)
            finally:
                reap_leftovers(tmp)
        if parallel:
            # --quick: F's holds (10 s each) run side by side, one child per transport, to
            # stay under a minute; the full run gives each its own turn.
            log(f"--quick: F on {', '.join(t for t, _ in parallel)} at the same time")
            threads = [threading.Thread(
                target=lambda t=t: failures.extend(run_child("F", t, args, only, tmp, out)))
                for t, _ in parallel]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            reap_leftovers(tmp)
    finally:
        clean_up(tmp, args.keep)
    took = time.perf_counter() - t0
    out.emit(None, "run", {"seconds": round(took, 1), "transports": transports,
                           "workloads": sorted(only), "failures": failures})
    out.close()
    print()
    print(render([r for r in out.rows if r.get("otlp") != "on"], quick=args.quick))
    if args.otlp:
        print()
        print(_otlp.table(out.rows))
    print(f"took {took:.1f} s" + (" (--quick)" if args.quick else ""))
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("bench: interrupted (every process it started was stopped)", file=sys.stderr)
        sys.exit(130)
