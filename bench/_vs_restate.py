"""``python -m bench --vs-restate``: Restate and stepd side by side, in cycles (issue 16).

Each cycle, on this machine and inside one loopback-only network namespace:

1. one synced LMDB commit (the embedded target's unit), median of 500;
2. Restate, as ``../shared/bench/peers/run-restate.sh`` drives it (``RUNS=1``,
   ``PEERS_NETNS`` = our namespace, ``--no-fsync-probe``, the same sizes);
3. stepd's A-D on each transport (``websocket``, ``http``, ``embedded``), each
   section a fresh ``python -m bench --child main`` on a fresh daemon, started
   with ``ip netns exec`` in the same namespace, with the defaults a user gets;
4. the cycle's ratios (`bench._ratios`).

Then the median of each ratio over the cycles and a table. Every row (Restate's
tagged ``"engine": "restate"``) goes to stdout and to the results file.

The namespace is made here (``ip netns add``, ``lo`` up, nothing else: Restate's
start-up release check fails at once and nothing leaves the machine) and
removed at the end. Every process is stopped by PID: Restate's driver by its
own PID file and cleanup, and on an interrupt its process tree, walked from
the PID we started, by PID.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench._ratios import cycle_ratios, median_ratios, render

ROOT = Path(__file__).resolve().parent.parent
RESTATE_TIMEOUT_S = 900
"""One Restate run (install check, A-D) at most; its own driver bounds it at 1200 s."""


def log(message: str) -> None:
    print(f"[vs-restate {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def peers_dir(given: Path | None) -> Path:
    """The peers' folder: given, or ``../shared/bench/peers`` beside the repository."""
    if given is not None:
        return given
    for base in (ROOT, *ROOT.parents):
        candidate = base / "shared" / "bench" / "peers"
        if (candidate / "run-restate.sh").exists():
            return candidate
    return Path("/work/shared/bench/peers")


def sizes(args: argparse.Namespace) -> dict[str, Any]:
    """The workload sizes, the same for both engines: stepd's params, Restate's flags."""
    return {"a_runs": args.a_runs, "a_one": args.a_runs, "b_wf": args.b_count,
            "c_settle": args.settle, "c_window": args.idle_seconds}


def restate_flags(args: argparse.Namespace) -> list[str]:
    return ["--a-runs", str(args.a_runs), "--a-steps", "20", "--b-count", str(args.b_count),
            "--b-steps", "3", "--concurrency", "100", "--idle-seconds", f"{args.idle_seconds:g}",
            "--settle", f"{args.settle:g}", "--no-fsync-probe"]


# --------------------------------------------------------------------------- the namespace


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, text=True)


@contextmanager
def loopback_netns(name: str | None) -> Iterator[str]:
    """A network namespace with only ``lo`` up (made and removed here unless given)."""
    if name is not None:
        yield name
        return
    made = f"stepd-vs-{os.getpid()}"
    _ip("netns", "add", made)
    try:
        _ip("-n", made, "link", "set", "lo", "up")
        log(f"network namespace {made}: lo only")
        yield made
    finally:
        subprocess.run(["ip", "netns", "del", made], check=False, capture_output=True)
        log(f"network namespace {made} removed")


# --------------------------------------------------------------------------- Restate


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_bytes()
            if int(raw[raw.rindex(b")") + 2:].split()[1]) == pid:
                out.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _tree(pid: int) -> list[int]:
    """pid's descendants, parents before children."""
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in _children(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def _stop_tree(proc: subprocess.Popen[str]) -> None:
    """SIGTERM the driver and everything under it, by PID; SIGKILL what is left after 40 s."""
    pids = [proc.pid, *_tree(proc.pid)]
    for pid in reversed(pids):  # the leaves first: bench.py's own cleanup then stops its server
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    try:
        proc.wait(40)
    except subprocess.TimeoutExpired:
        pass
    for pid in [proc.pid, *_tree(proc.pid), *pids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def run_restate(cycle: int, netns: str, args: argparse.Namespace, peers: Path,
                results: Path) -> tuple[list[dict[str, Any]], str | None]:
    """One Restate run in the namespace; its JSON rows (and a failure, if any)."""
    env = dict(os.environ, PEERS_NETNS=netns, RUNS="1", BENCH_LABEL=f"cycle{cycle}",
               BENCH_RESULTS=str(results))
    cmd = [str(peers / "run-restate.sh"), *restate_flags(args)]
    log(f"cycle {cycle}: Restate ({' '.join(cmd)})")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    rows: list[dict[str, Any]] = []
    deadline = time.monotonic() + RESTATE_TIMEOUT_S
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("{"):
                rows.append(json.loads(line))
            if time.monotonic() > deadline:
                raise TimeoutError(f"Restate over {RESTATE_TIMEOUT_S} s")
        code = proc.wait()
    except BaseException:
        _stop_tree(proc)
        raise
    failure = None
    if code != 0:
        failure = f"restate cycle {cycle}: run-restate.sh exited {code}"
    elif not {"A", "B", "C", "D"} <= {r.get("workload") for r in rows}:
        failure = f"restate cycle {cycle}: rows missing ({sorted(r.get('workload') for r in rows)})"
    return rows, failure


# --------------------------------------------------------------------------- the run


def _commit(head: str = "HEAD") -> str:
    try:
        sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", head],
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


def run_vs_restate(args: argparse.Namespace, transports: list[str]) -> int:
    """The whole side-by-side run; the exit status (1: a failure, a wrong result)."""
    from bench.__main__ import Output, clean_up, machine, reap_leftovers, run_child
    from bench.engine import synced_commit_baseline

    peers = peers_dir(args.peers_dir)
    if not (peers / "run-restate.sh").exists():
        log(f"no run-restate.sh in {peers} (--peers-dir)")
        return 2
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out_path = args.out or Path(f"vs-restate-{stamp}.jsonl")
    out = Output(out_path, False, args.daemon_arg, args.embedded_gc, args.client_loop)
    tmp = Path(tempfile.mkdtemp(prefix="stepd-vs-restate-"))
    failures: list[str] = []
    cycles: list[list[dict[str, Any]]] = []
    params = sizes(args)
    t0 = time.perf_counter()
    out.emit(None, "meta", {"commit": _commit(), "cycles": args.cycles, "sizes": params,
                            "transports": transports, "client_loop": args.client_loop,
                            "worker_concurrency": args.worker_concurrency,
                            "embedded_gc": args.embedded_gc, "machine": machine()})
    try:
        with loopback_netns(args.netns) as ns:
            prefix = ["ip", "netns", "exec", ns]
            for cycle in range(1, args.cycles + 1):
                tag = {"cycle": cycle}
                commit_ms = round(synced_commit_baseline(tmp / f"baseline-{cycle}") * 1000, 3)
                out.emit(None, "baseline", {**tag, "synced_lmdb_commit_ms_median": commit_ms})
                rows, failure = run_restate(cycle, ns, args, peers, tmp / "restate.jsonl")
                for row in rows:
                    out.add({"engine": "restate", **row, **tag})
                if failure:
                    failures.append(failure)
                by: dict[str, dict[str, dict[str, Any]]] = {
                    "restate": {r["workload"]: r for r in rows if "workload" in r}}
                for transport in transports:
                    log(f"cycle {cycle}: stepd {transport}")
                    before = len(out.rows)
                    try:
                        failures += run_child("main", transport, args, {"A", "B", "C", "D"},
                                              tmp, out, tag, prefix=prefix, params=params)
                    finally:
                        reap_leftovers(tmp)
                    by[transport] = {r["workload"]: r for r in out.rows[before:]
                                     if r.get("engine") == "stepd"}
                ratios = cycle_ratios(by, commit_ms, transports)
                for row in ratios:
                    out.add({"engine": "vs-restate", "workload": "ratio", **tag, **row})
                cycles.append(ratios)
    finally:
        clean_up(tmp, args.keep)
    medians = median_ratios(cycles)
    for row in medians:
        out.add({"engine": "vs-restate", "workload": "ratio_median", **row})
    out.emit(None, "run", {"seconds": round(time.perf_counter() - t0, 1), "failures": failures})
    out.close()
    print()
    print(render(medians))
    print(f"took {time.perf_counter() - t0:.0f} s; rows in {out_path}")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    return 0
