"""Daemon benchmark: in-process, no network, durable storage.

    python -m bench.engine [--runs-1 N] [--runs-100 N] [--steps 20]

Runs of a 20-step sequential workflow (PEERS.md's seq(n): each step adds its
index to an accumulator; every result is checked) driven by a tight
in-process worker loop calling the engine directly (claim, started,
complete). Prints the per-step time (median, p99) and steps/s at 1 and 100
concurrent runs, beside a baseline measured in the same run on the same disk:
one synced LMDB commit (the physical floor of a durable step).

Not a test: timings are never asserted (these machines are noisy).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import lmdb

from stepd.actors.daemon import Daemon
from stepd.sansio.lease import Op


def seq(n: int) -> dict[str, Any]:
    return {
        "name": f"seq{n}",
        "steps": [
            {"id": f"s{i}", "kind": "task", "body": "add", "input": {"i": i, "acc": f"${{steps.s{i - 1}}}"}}
            if i else {"id": "s0", "kind": "task", "body": "add", "input": {"i": 0, "acc": 0}}
            for i in range(n)
        ],
    }


def synced_commit_baseline(path: Path, n: int = 500) -> float:
    """Median seconds of one synced LMDB commit of a ~200-byte record."""
    env = lmdb.open(str(path), map_size=64 << 20, sync=True)
    times = []
    value = b"x" * 200
    for i in range(n):
        t = time.perf_counter()
        with env.begin(write=True) as txn:
            txn.put(i.to_bytes(8, "big"), value)
        times.append(time.perf_counter() - t)
    env.close()
    return statistics.median(times)


async def worker(engine: Daemon, worker_id: str, stop: anyio.Event, step_times: list[float]) -> None:
    """A worker with concurrency 128: each lease runs in its own task, as the SDK's would."""
    last: dict[str, float] = {}
    slots = anyio.Semaphore(128)

    async def serve(lease: dict[str, Any]) -> None:
        try:
            run_id = lease["run_id"]
            await engine.lease_call(lease["lease_id"], Op.STARTED, {})
            i = lease["input"]["i"]
            acc = lease["input"]["acc"]
            await engine.lease_call(lease["lease_id"], Op.COMPLETE, {"output": acc + i})
            now = time.perf_counter()
            if run_id in last:
                step_times.append(now - last[run_id])
            last[run_id] = now
        finally:
            slots.release()

    async with anyio.create_task_group() as tg:
        while not stop.is_set():
            free = max(1, slots.value)
            leases = await engine.claim(worker_id, max=free, wait_ms=50)
            for lease in leases:
                await slots.acquire()
                tg.start_soon(serve, lease)


async def measure(path: str, *, concurrent: int, runs: int, steps: int) -> dict[str, Any]:
    async with Daemon.open(path) as engine:
        defn = seq(steps)
        reg = await engine.register_worker(name="bench", definitions=[defn])
        wid = reg["worker_id"]
        stop = anyio.Event()
        step_times: list[float] = []
        expected = steps * (steps - 1) // 2
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker, engine, wid, stop, step_times)
            # warm-up (not counted): 3 runs
            for _ in range(3):
                r, _ = await engine.start_run(defn["name"])
                await wait_done(engine, r)
            step_times.clear()
            t0 = time.perf_counter()
            sem = anyio.Semaphore(concurrent)
            results: list[Any] = []

            async def one() -> None:
                async with sem:
                    r, _ = await engine.start_run(defn["name"])
                    results.append(await wait_done(engine, r))

            async with anyio.create_task_group() as runs_tg:
                for _ in range(runs):
                    runs_tg.start_soon(one)
            wall = time.perf_counter() - t0
            stop.set()
        bad = [r for r in results if r != expected]
        if bad:
            raise SystemExit(f"wrong results: {bad[:3]} (expected {expected})")
        step_times.sort()
        return {
            "concurrent_runs": concurrent,
            "runs": runs,
            "steps_per_run": steps,
            "steps_per_s": round(runs * steps / wall, 1),
            "per_step_ms_median": round(statistics.median(step_times) * 1000, 3),
            "per_step_ms_p99": round(step_times[int(len(step_times) * 0.99) - 1] * 1000, 3),
            "storage": engine.storage.statistics().__dict__ if hasattr(engine.storage.statistics(), "__dict__") else None,
        }


async def wait_done(engine: Daemon, run_id: str) -> Any:
    while True:
        view = await engine.result(run_id, wait_ms=10_000)
        if view["status"] == "completed":
            return view["result"]
        if view["status"] in ("failed", "cancelled", "timed_out"):
            raise SystemExit(f"run {run_id} ended {view['status']}: {view['error']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--runs-1", type=int, default=30, help="runs measured one at a time")
    parser.add_argument("--runs-100", type=int, default=300, help="runs measured 100 at a time")
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    parser.add_argument("--uvloop", action="store_true", help="asyncio on uvloop")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = synced_commit_baseline(Path(tmp) / "baseline")
        rows = []
        for concurrent, runs in ((1, args.runs_1), (100, args.runs_100)):
            path = str(Path(tmp) / f"engine-{concurrent}")
            rows.append(anyio.run(
                functools.partial(measure, path, concurrent=concurrent, runs=runs,
                                  steps=args.steps),
                backend=args.backend,
                backend_options={"use_uvloop": True} if args.uvloop else {},
            ))
    print(f"baseline: one synced LMDB commit, median {base * 1000:.3f} ms (same disk, same run)")
    print(f"{'concurrent runs':>16} {'steps/s':>10} {'per-step median':>16} {'p99':>10} {'median / commit':>16}")
    for row in rows:
        ratio = row["per_step_ms_median"] / (base * 1000)
        print(f"{row['concurrent_runs']:>16} {row['steps_per_s']:>10,.0f} "
              f"{row['per_step_ms_median']:>13.3f} ms {row['per_step_ms_p99']:>7.3f} ms {ratio:>15.2f}x")
    for row in rows:
        row.pop("storage", None)
        print(json.dumps({"engine": "stepd", "transport": "in-process-engine", "backend": args.backend,
                          "baseline_commit_ms": round(base * 1000, 3), **row}))


if __name__ == "__main__":
    main()
