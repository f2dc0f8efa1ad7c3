"""SDK benchmark: end-to-end step latency through `stepd.Worker` and `stepd.Client`.

    python -m bench.sdk [--runs 100] [--one-step 200] [--steps 20] [--transports embedded,websocket,http]

A 20-step sequential no-op workflow (PEERS.md's seq(n): each step adds its
index to the previous step's output; every result is checked against
n(n-1)/2), run one run at a time, on three transports, each on a fresh data
directory with durable (synced) storage:

* ``embedded``: ``stepd.embedded(dir)``, the daemon in this process
  (in-process push to the worker, no sockets);
* ``websocket``: ``python -m stepd serve`` in a subprocess on 127.0.0.1, the
  worker on its WebSocket (push);
* ``http``: the same daemon, the worker forced to HTTP long-poll (claim).

The worker and the client run in this process (one Python process for the
SDK side, a second one for the daemon on the network transports). Printed per
transport: the per-step latency (a body's start to the next body's start in
the same run: the completion sent and committed, the next step scheduled, its
lease offered and pushed or claimed),
median and p95, the sequential steps/s, and the end-to-end latency of a
1-step run from the client (``start`` to ``result()`` returning), median and
p95. The baseline, measured in the same run on the same disk, is one synced
LMDB commit of a ~200-byte record (bench.engine's).

Not a test: timings are never asserted (these machines are noisy).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import stepd
from bench.engine import synced_commit_baseline

TRANSPORTS = ("embedded", "websocket", "http")


def seq(n: int) -> stepd.Workflow:
    wf = stepd.Workflow(f"seq{n}", version="bench.v1")
    for i in range(n):
        acc: Any = 0 if i == 0 else f"${{steps.s{i - 1}}}"
        wf.then("add", id=f"s{i}", input={"i": i, "acc": acc})
    return wf


ONE = stepd.Workflow("one", version="bench.v1").then("add", id="s0", input={"i": 1, "acc": 41})


class Clock:
    """When each run's bodies started (perf_counter), to measure step to step."""

    def __init__(self) -> None:
        self.starts: dict[str, list[float]] = defaultdict(list)

    async def add(self, ctx: stepd.StepContext, input: dict[str, int]) -> int:
        self.starts[ctx.run_id].append(time.perf_counter())
        return input["acc"] + input["i"]


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p * len(ordered)) - 1))]


@contextmanager
def daemon_process(data: Path) -> Iterator[str]:
    """``python -m stepd serve`` on a free port; yields its URL; SIGTERM by PID after."""
    cmd = [sys.executable, "-m", "stepd", "serve", "--data", str(data), "--port", "0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPD_")}
    err = (data.parent / f"{data.name}.stderr").open("w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        while True:
            line = lines.get(timeout=20)
            if line is None:
                raise SystemExit(f"stepd serve exited {proc.wait()} before listening")
            found = re.search(r"stepd listening on (http://\S+) ", line)
            if found:
                break
        yield found.group(1)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(20)
        err.close()


@contextmanager
def target_for(transport: str, data: Path) -> Iterator[Any]:
    if transport == "embedded":
        with stepd.embedded(data) as daemon:
            yield daemon
    else:
        with daemon_process(data) as url:
            yield url


def measure(transport: str, data: Path, *, runs: int, one_step: int, steps: int) -> dict[str, Any]:
    clock = Clock()
    wf = seq(steps)
    expected = steps * (steps - 1) // 2
    with target_for(transport, data) as target:
        client = stepd.Client(target, trust_env=False)
        options = {} if transport == "embedded" else {"transport": transport}
        worker = stepd.Worker(client, concurrency=8, name=f"bench-{transport}", **options)
        worker.register(wf, ONE, bodies={"add": clock.add})
        thread = threading.Thread(target=worker.serve, kwargs={"handle_signals": False})
        thread.start()
        try:
            assert worker.wait_ready(20), "the worker did not register"
            assert worker.transport == ("inprocess" if transport == "embedded" else transport)
            for _ in range(3):  # warm-up, not counted
                assert client.start(wf).result(timeout=60) == expected
                assert client.start(ONE).result(timeout=60) == 42
            clock.starts.clear()

            t0 = time.perf_counter()
            handles = []
            for _ in range(runs):
                run = client.start(wf)
                result = run.result(timeout=60)
                if result != expected:
                    raise SystemExit(f"{transport}: run {run} returned {result}, not {expected}")
                handles.append(run)
            wall = time.perf_counter() - t0
            per_step = []
            for run in handles:
                starts = clock.starts[run.run_id]
                if len(starts) != steps:
                    raise SystemExit(f"{transport}: run {run} ran {len(starts)} bodies, not {steps}")
                per_step.extend(b - a for a, b in itertools.pairwise(starts))

            end_to_end = []
            for _ in range(one_step):
                t = time.perf_counter()
                result = client.start(ONE).result(timeout=60)
                end_to_end.append(time.perf_counter() - t)
                if result != 42:
                    raise SystemExit(f"{transport}: a 1-step run returned {result}, not 42")
        finally:
            worker.stop()
            thread.join(30)
            client.close()
    return {
        "transport": transport,
        "runs": runs,
        "steps_per_run": steps,
        "per_step_ms_median": round(statistics.median(per_step) * 1000, 3),
        "per_step_ms_p95": round(pct(per_step, 0.95) * 1000, 3),
        "steps_per_s": round(runs * steps / wall, 1),
        "one_step_runs": one_step,
        "one_step_ms_median": round(statistics.median(end_to_end) * 1000, 3),
        "one_step_ms_p95": round(pct(end_to_end, 0.95) * 1000, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--runs", type=int, default=100, help="20-step runs per transport")
    parser.add_argument("--one-step", type=int, default=200, help="1-step runs per transport")
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    args = parser.parse_args()
    transports = [t for t in args.transports.split(",") if t]
    for t in transports:
        if t not in TRANSPORTS:
            raise SystemExit(f"unknown transport {t!r}; expected {', '.join(TRANSPORTS)}")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="stepd-bench-sdk-") as tmp:
        base = synced_commit_baseline(Path(tmp) / "baseline")
        rows = [measure(t, Path(tmp) / t, runs=args.runs, one_step=args.one_step,
                        steps=args.steps) for t in transports]
    base_ms = base * 1000
    print(f"baseline: one synced LMDB commit, median {base_ms:.3f} ms (same disk, same run)")
    print(f"{args.runs} runs of {args.steps} no-op steps, one at a time; {args.one_step} 1-step "
          "runs; worker and client in this process; every result checked")
    print(f"{'transport':>10} {'per-step median':>16} {'p95':>10} {'steps/s':>9} "
          f"{'1-step e2e median':>18} {'p95':>10} {'step / commit':>14}")
    for r in rows:
        print(f"{r['transport']:>10} {r['per_step_ms_median']:>13.3f} ms {r['per_step_ms_p95']:>7.3f} ms"
              f" {r['steps_per_s']:>9,.0f} {r['one_step_ms_median']:>15.3f} ms"
              f" {r['one_step_ms_p95']:>7.3f} ms {r['per_step_ms_median'] / base_ms:>13.2f}x")
    for r in rows:
        print(json.dumps({"bench": "sdk", "baseline_commit_ms": round(base_ms, 3), **r}))
    print(f"took {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
