"""The span export's child process: ``python -m stepd._otel_child URL BATCH`` (docs/otel.md).

Started and stopped by `stepd.otel.SpanExport`, which writes frames to its
standard input: a 4-byte big-endian length, then a msgpack list of slimmed
run writes. For each frame it builds the spans (`TraceBuilder`), makes SDK
spans of them (`stepd._otel_spans`) and sends them to ``URL`` in requests of
at most ``BATCH`` spans with OpenTelemetry's ``OTLPSpanExporter``, then
answers one line on standard output: ``exported failed forgotten``, totals
so far. At the end of its input it shuts the exporter down, answers once
more and exits; when the daemon dies, its input ends too.

Why a process: see `stepd.otel`. Its logs (the exporter's failures) go to
standard error, which is the daemon's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import BinaryIO, TextIO

import msgpack  # type: ignore[import-untyped]  # no stubs published


def serve(url: str, batch: int, frames: BinaryIO, answers: TextIO) -> None:
    """Export every frame of ``frames``; answer each on ``answers``."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult

    from stepd._otel_spans import Converter
    from stepd.sansio.trace import TraceBuilder

    exporter = OTLPSpanExporter(endpoint=url)
    convert = Converter()
    builder = TraceBuilder()
    exported = failed = 0
    try:
        while True:
            head = frames.read(4)
            if len(head) < 4:
                break
            writes = msgpack.unpackb(frames.read(int.from_bytes(head, "big")))
            spans = []
            for run_id, record, journal, leases, lease_status in writes:
                spans.extend(builder.feed(run_id, record, journal, leases, lease_status))
            for i in range(0, len(spans), batch):
                chunk = convert.spans(spans[i:i + batch])
                if exporter.export(chunk) is SpanExportResult.SUCCESS:
                    exported += len(chunk)
                else:
                    failed += len(chunk)
            answers.write(f"{exported} {failed} {builder.forgotten}\n")
            answers.flush()
    finally:
        exporter.shutdown()  # type: ignore[no-untyped-call]  # the SDK leaves it untyped
    answers.write(f"{exported} {failed} {builder.forgotten}\n")
    answers.flush()


def main() -> None:
    # Best effort yields to the daemon: when the cores are busy, the daemon's work goes
    # first, and a child that falls behind backs up into the bounded queue (counted drops).
    with contextlib.suppress(OSError):
        os.nice(10)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s (span export): %(message)s")
    url, batch = sys.argv[1], int(sys.argv[2])
    serve(url, max(1, batch), sys.stdin.buffer, sys.stdout)


if __name__ == "__main__":
    main()
