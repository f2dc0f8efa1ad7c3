"""Storage benchmark: group commit vs. one synced transaction per write.

Run: ``python -m bench.storage [--seconds 2] [--reps 3] [--backend asyncio|trio]``

For 1, 8 and 64 concurrent writers (each a task doing ``await storage.write``
of a ~200-byte record in a loop), it reports acknowledged writes per second
and synced commits per second, beside a baseline measured in the same run:
the same writes done one transaction each (a plain loop of
``with env.begin(write=True)`` commits on a thread, synced). Every
configuration gets a fresh temporary directory and durable sync, except one
line with ``sync=False``, labelled UNSAFE, for comparison. Figures are medians
of ``--reps`` repetitions (configurations interleaved, so drift hits all of
them alike); the ratio is to the baseline's median. The loop-lag column is
the p99 lateness of a ``sleep(1 ms)`` ticker running beside the writers: the
event loop must keep turning while commits are synced.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import lmdb

from stepd.storage import Storage, WriteTxn, encode

RECORD = encode({"run_id": "r" * 26, "status": "running", "step": 7, "pad": b"\x5a" * 140})
WRITER_COUNTS = (1, 8, 64)


@dataclass
class Result:
    writes_per_s: float
    commits_per_s: float
    loop_lag_p99_ms: float | None = None


def put_txn(txn: WriteTxn, key: bytes, value: bytes) -> None:
    txn.put_raw("journal", key, value)


def one_txn_each(path: Path, seconds: float) -> Result:
    """The baseline: one synced write transaction per write, on one thread."""
    env = lmdb.open(str(path), map_size=1 << 30, max_dbs=4, sync=True)
    db = env.open_db(b"journal")
    count = 0

    def loop() -> None:
        nonlocal count
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            with env.begin(write=True) as txn:
                txn.put(b"%012d" % count, RECORD, db=db)
            count += 1

    started = time.perf_counter()
    thread = threading.Thread(target=loop, name="bench-baseline")
    thread.start()
    thread.join()
    elapsed = time.perf_counter() - started
    env.close()
    return Result(count / elapsed, count / elapsed)


async def group_commit(path: Path, seconds: float, writers: int, sync: bool) -> Result:
    """``writers`` tasks each awaiting ``storage.write`` in a loop."""
    acked = 0
    lags: list[float] = []
    async with Storage.open(path, map_size=1 << 30, max_map_size=1 << 32, sync=sync) as storage:
        before = storage.statistics()
        deadline = time.perf_counter() + seconds

        async def writer(w: int) -> None:
            nonlocal acked
            i = 0
            while time.perf_counter() < deadline:
                await storage.write(put_txn, b"%03d-%09d" % (w, i), RECORD)
                acked += 1
                i += 1

        async def ticker() -> None:
            while time.perf_counter() < deadline:
                t = time.perf_counter()
                await anyio.sleep(0.001)
                lags.append(time.perf_counter() - t - 0.001)

        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            for w in range(writers):
                tg.start_soon(writer, w)
        elapsed = time.perf_counter() - started
        commits = storage.statistics().commits - before.commits
    lags.sort()
    p99 = lags[int(len(lags) * 0.99)] * 1000 if lags else None
    return Result(acked / elapsed, commits / elapsed, p99)


def median(results: list[Result], pick: Callable[[Result], float | None]) -> float:
    values = [v for v in map(pick, results) if v is not None]
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument("--dir", default=None, help="where the temporary directories go")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the sync=False warning is in the label

    configs: list[tuple[str, Callable[[Path], Result]]] = [
        ("one txn each (baseline)", lambda p: one_txn_each(p, args.seconds)),
    ]

    def grouped(writers: int, sync: bool) -> Callable[[Path], Result]:
        return lambda p: anyio.run(
            group_commit, p, args.seconds, writers, sync, backend=args.backend
        )

    for n in WRITER_COUNTS:
        configs.append((f"group commit, {n} writer{'s' if n > 1 else ''}", grouped(n, True)))
    configs.append(("group commit, 64 writers, sync=False (UNSAFE)", grouped(64, False)))

    results: dict[str, list[Result]] = {name: [] for name, _ in configs}
    started = time.perf_counter()
    for _ in range(args.reps):
        for name, run in configs:
            with tempfile.TemporaryDirectory(prefix="stepd-bench-", dir=args.dir) as tmp:
                results[name].append(run(Path(tmp) / "db"))

    base = median(results[configs[0][0]], lambda r: r.writes_per_s)
    print(
        f"stepd storage benchmark: {args.backend}, ~{len(RECORD)}-byte records, "
        f"{args.seconds:g} s per measurement, median of {args.reps}, lmdb {lmdb.__version__}"
    )
    print(
        f"{'configuration':<48}{'acked writes/s':>15}{'commits/s':>11}"
        f"{'writes/commit':>14}{'x baseline':>11}{'loop lag p99':>14}"
    )
    for name, _ in configs:
        writes = median(results[name], lambda r: r.writes_per_s)
        commits = median(results[name], lambda r: r.commits_per_s)
        lag = median(results[name], lambda r: r.loop_lag_p99_ms)
        lag_text = "" if math.isnan(lag) else f"{lag:.2f} ms"
        print(
            f"{name:<48}{writes:>15,.0f}{commits:>11,.0f}{writes / commits:>14.1f}"
            f"{writes / base:>11.2f}{lag_text:>14}"
        )
    print(f"(total {time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
