"""``python -m bench.otel_pack``: the event loop's CPU for span export's hand-off, per step.

    python -m bench.otel_pack [--runs 300] [--repeat 7]

`stepd.otel.SpanExport.committed` packs each committed write on the event
loop's thread (docs/otel.md, "Where the work happens"). This measures that
and nothing else: it records the writes a real embedded daemon hands over
for ``--runs`` x seq(3) (B's workflow; export to a counting sink), then hands
copies of them to a fresh, unstarted export ``--repeat`` times and takes the
least thread CPU (``time.thread_time``): microseconds per write and per step,
and bytes packed per step. No pipe write is counted (it happens once per
100 ms, not per write).
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

import stepd.otel
from bench import _setups
from bench._workloads import warm_up
from bench.otel_cost import STEPS, start_sink, workload


async def record(tmp: Path, url: str, runs: int) -> list[Any]:
    """The writes the daemon hands over for ``runs`` runs (after the warm-up), copied."""
    seen: list[Any] = []
    original = stepd.otel.SpanExport.committed

    def recording(self: stepd.otel.SpanExport, write: Any) -> None:
        if recording.on:  # type: ignore[attr-defined]
            seen.append(copy.deepcopy(write))
        original(self, write)

    recording.on = False  # type: ignore[attr-defined]
    stepd.otel.SpanExport.committed = recording  # type: ignore[method-assign]
    try:
        async with _setups.embedded(tmp, concurrency=None, otlp_endpoint=url) as s:
            await warm_up(s)
            recording.on = True  # type: ignore[attr-defined]
            await workload(s, runs)
            recording.on = False  # type: ignore[attr-defined]
    finally:
        stepd.otel.SpanExport.committed = original  # type: ignore[method-assign]
    return seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args(argv)
    sink, url = start_sink()
    try:
        with tempfile.TemporaryDirectory(prefix="stepd-otel-pack-") as tmp:
            writes = anyio.run(record, Path(tmp), url, args.runs)
    finally:
        sink.terminate()
        sink.wait(10)
    stepd.otel.FLUSH_BYTES = 1 << 40  # packing alone: no flush inside the timed loop
    best = float("inf")
    packed = 0
    for _ in range(args.repeat):
        export = stepd.otel.SpanExport(url, max_queue=1 << 40)  # never started
        copies = copy.deepcopy(writes)
        began = time.thread_time()
        for w in copies:
            export.committed(w)
        best = min(best, time.thread_time() - began)
        packed = len(export._buf)
    steps = args.runs * STEPS
    print(f"{len(writes)} writes for {steps} steps ({len(writes) / steps:.2f} per step); "
          f"packing: {best / len(writes) * 1e6:.2f} us per write, "
          f"{best / steps * 1e6:.2f} us per step, {packed / steps:,.0f} bytes per step "
          f"(least of {args.repeat})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
