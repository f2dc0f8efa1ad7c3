"""``python -m bench.turns``: where an embedded step's wall time goes, counted.

    python -m bench.turns [--runs 10]

Sequential workload A (``seq(20)`` one run at a time) on ``stepd.embedded`` with a
worker and a client on one asyncio loop (bench's embedded setup, as a user writes
it), after the warm-up. Per step it counts what costs wall time beyond Python
calls (``python -m bench.calls`` counts those): event-loop turns (asyncio's
``_run_once``), callbacks run (task steps included), hand-offs from the storage
writer thread back to the loop (``call_soon_threadsafe``), submissions to the
writer (each wakes its thread), commits, and the bytes written to the disk
(``/proc/self/io`` ``write_bytes``: the commits' pages and the ext4 journal),
beside the same bytes of bench's one-record baseline commit. Wall time per step
and the share of it the loop spent waiting in ``select`` are printed too: they
move with the machine's load, the counts do not.

Instrumentation: asyncio's loop and handle methods and the writer's ``submit``
are wrapped for the counted window only (docs/architecture.md "A step in process").
"""

from __future__ import annotations

import argparse
import asyncio
import asyncio.base_events
import asyncio.events
import collections
import json
import selectors
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import _setups
from bench._workloads import run_seq, warm_up
from bench.engine import synced_commit_baseline
from stepd.storage import _writer

STEPS = 20


def _write_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("write_bytes"):
                return int(line.split()[1])
    return 0


class _Probe:
    """Counters, and the wrappers that feed them while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.counts: collections.Counter[str] = collections.Counter()
        self.select_s = 0.0

    def install(self) -> None:
        probe = self
        run_once = asyncio.base_events.BaseEventLoop._run_once  # type: ignore[attr-defined]
        handle_run = asyncio.events.Handle._run
        threadsafe = asyncio.base_events.BaseEventLoop.call_soon_threadsafe
        select = selectors.EpollSelector.select
        submit = _writer.Writer.submit

        def _run_once(loop: Any) -> None:
            if probe.on:
                probe.counts["loop turns"] += 1
            run_once(loop)

        def _handle_run(handle: Any) -> None:
            if probe.on:
                probe.counts["callbacks run (task steps included)"] += 1
            handle_run(handle)

        def _threadsafe(loop: Any, *args: Any, **kwargs: Any) -> Any:
            if probe.on:
                probe.counts["thread hand-offs to the loop"] += 1
            return threadsafe(loop, *args, **kwargs)

        def _select(sel: Any, timeout: float | None = None) -> Any:
            t = time.perf_counter()
            try:
                return select(sel, timeout)
            finally:
                if probe.on:
                    probe.select_s += time.perf_counter() - t

        def _submit(writer: Any, requests: Any) -> None:
            if probe.on:
                probe.counts["submissions to the writer"] += 1
            submit(writer, requests)

        asyncio.base_events.BaseEventLoop._run_once = _run_once  # type: ignore[attr-defined]
        asyncio.events.Handle._run = _handle_run  # type: ignore[method-assign]
        asyncio.base_events.BaseEventLoop.call_soon_threadsafe = _threadsafe  # type: ignore[method-assign]
        selectors.EpollSelector.select = _select  # type: ignore[method-assign]
        _writer.Writer.submit = _submit  # type: ignore[method-assign]


async def _measure(runs: int, probe: _Probe) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="stepd-turns-") as tmp:
        async with _setups.embedded(Path(tmp) / "data", concurrency=None) as s:
            await warm_up(s)
            await asyncio.sleep(1.25)  # the warm-up's deferred work is done
            commits0, bytes0 = await s.commits(), _write_bytes()
            probe.on = True
            t = time.perf_counter()
            for _ in range(runs):
                await run_seq(s, STEPS)
            wall = time.perf_counter() - t
            probe.on = False
            commits, written = await s.commits() - commits0, _write_bytes() - bytes0
        base_bytes0 = _write_bytes()
        synced_commit_baseline(Path(tmp) / "baseline", 200)
        base_bytes = (_write_bytes() - base_bytes0) / 200
    steps = runs * STEPS
    out: dict[str, Any] = {k: round(v / steps, 2) for k, v in sorted(probe.counts.items())}
    out["commits"] = round(commits / steps, 2)
    out["bytes written"] = round(written / steps)
    out["bytes written by one baseline commit"] = round(base_bytes)
    out["wall ms (moves with load)"] = round(wall / steps * 1000, 3)
    out["of which the loop waited in select, ms"] = round(probe.select_s / steps * 1000, 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.turns", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="seq(20) runs counted")
    args = parser.parse_args()
    probe = _Probe()
    probe.install()
    result = asyncio.run(_measure(args.runs, probe))
    print(json.dumps({"bench": "turns", "setup": "embedded", "per_step": result}))
    for key, value in result.items():
        print(f"{key:42s} {value:>10}")


if __name__ == "__main__":
    main()
