"""The span export's child process: ``python -m stepd._otel_child URL BATCH`` (docs/otel.md).

Started and stopped by `stepd.otel.SpanExport`, which writes frames to its
standard input: a 4-byte big-endian length, then one or more msgpack arrays
of committed run writes, each ``[run_id, record or nil, journal, leases,
lease_status]`` as the daemon committed them (the record only when the write
ends the run). For each frame it builds the spans (`TraceBuilder`), encodes
them as OTLP protobuf (`stepd._otlp_proto`) and sends them to ``URL`` in
requests of at most ``BATCH`` spans through OpenTelemetry's
``OTLPSpanExporter`` (its HTTP client: ``OTEL_EXPORTER_OTLP_HEADERS``,
``..._TIMEOUT``, ``..._COMPRESSION``, ``..._CERTIFICATE`` and the rest), then
answers one line on standard output: ``exported failed forgotten``, totals
so far. At the end of its input it shuts the exporter down, answers once
more and exits; when the daemon dies, its input ends too.

Why a process, and why the daemon sends whole writes: see `stepd.otel`. Its
logs (the exporter's failures) go to standard error, which is the daemon's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO, TextIO

import msgpack  # type: ignore[import-untyped]  # no stubs published

from stepd.sansio.trace import SpanData

__all__ = ["sender", "serve", "writes_of"]

log = logging.getLogger("stepd.otel")


def writes_of(frame: bytes) -> list[Any]:
    """The run writes of one frame (the arrays it holds, in order)."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=len(frame) + 1)
    unpacker.feed(frame)
    out: list[Any] = []
    for chunk in unpacker:
        out.extend(chunk)
    return out


def sender(exporter: Any, *, direct: bool = True) -> Callable[[Sequence[SpanData]], bool]:
    """How a batch of spans goes out: True when the collector took it.

    Directly: the request encoded by `stepd._otlp_proto`, sent by the
    exporter's own HTTP client (so the standard variables keep applying).
    That client is not public API; an exporter without it (``direct=False``,
    or another version of the package) gets SDK spans through its public
    ``export``, which costs several times the CPU per span.
    """
    client: Any = getattr(exporter, "_client", None)
    if direct and callable(getattr(client, "export", None)):
        from stepd import __version__
        from stepd._otel_spans import resource
        from stepd._otlp_proto import encode_request, encode_scope

        found = resource()
        attributes = dict(found.attributes)
        schema_url = found.schema_url or ""
        scope = encode_scope("stepd", __version__)

        def send_direct(spans: Sequence[SpanData]) -> bool:
            try:
                data = encode_request(attributes, scope, spans, schema_url)
            except (TypeError, ValueError) as exc:  # as the SDK's export: the batch fails
                log.error("stepd: could not encode %d spans: %r", len(spans), exc)
                return False
            return bool(getattr(client.export(data), "success", False))

        return send_direct

    from opentelemetry.sdk.trace.export import SpanExportResult

    from stepd._otel_spans import Converter

    convert = Converter()
    log.debug("stepd: span export through the SDK's span objects (no direct client)")

    def send_sdk(spans: Sequence[SpanData]) -> bool:
        return exporter.export(convert.spans(spans)) is SpanExportResult.SUCCESS

    return send_sdk


def serve(url: str, batch: int, frames: BinaryIO, answers: TextIO) -> None:
    """Export every frame of ``frames``; answer each on ``answers``."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    from stepd.sansio.trace import TraceBuilder

    exporter = OTLPSpanExporter(endpoint=url)
    send = sender(exporter)
    builder = TraceBuilder()
    exported = failed = 0
    try:
        while True:
            head = frames.read(4)
            if len(head) < 4:
                break
            spans: list[SpanData] = []
            for run_id, record, journal, leases, lease_status in writes_of(
                    frames.read(int.from_bytes(head, "big"))):
                spans.extend(builder.feed(run_id, record or {}, journal, leases, lease_status))
            for i in range(0, len(spans), batch):
                chunk = spans[i:i + batch]
                if send(chunk):
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
