"""The span export's child: ``python -m stepd._otel_child URL BATCH DELAY_S FD`` (docs/otel.md).

Started and stopped by `stepd.otel.SpanExport`, which writes the committed
run writes to its standard input as a stream (`stepd._otel_wire`). It reads
whatever has arrived, builds the spans (`TraceBuilder`), and sends them,
encoded as OTLP protobuf (`stepd._otlp_proto`), to ``URL`` through
OpenTelemetry's ``OTLPSpanExporter`` (its HTTP client:
``OTEL_EXPORTER_OTLP_HEADERS``, ``..._TIMEOUT``, ``..._COMPRESSION``,
``..._CERTIFICATE`` and the rest): a request as soon as ``BATCH`` spans are
waiting, else once the oldest has waited ``DELAY_S``. Its counts go into the
shared file ``FD`` (`stepd._otel_wire.Counters`). At the end of its input it
sends what it holds, shuts the exporter down and exits; when the daemon
dies, its input ends too.

Why a process, and why the daemon sends whole writes: see `stepd.otel`. Its
logs (the exporter's failures) go to standard error, which is the daemon's.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack  # type: ignore[import-untyped]  # no stubs published

from stepd._otel_wire import DONE, EXPORTED, FAILED, FORGOTTEN, RECEIVED, RUN_FIELDS, Counters
from stepd.sansio.trace import SpanData

__all__ = ["sender", "serve", "unpacker", "writes_of"]

log = logging.getLogger("stepd.otel")

READ_BYTES = 1 << 20
"""At most this much is read per wake-up (the daemon's pipe holds about as much)."""
READ_EVERY_S = 0.2
"""After a read that emptied the pipe the child naps this long: it wakes fewer times, each
with more to do (what arrives meanwhile waits in the pipe, and past it in the daemon's
buffer, both bounded). A read that filled `READ_BYTES` is followed by the next at once."""


def unpacker() -> Any:
    """An unpacker of the stream: whatever bytes arrived, fed as they came."""
    return msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=0)


def writes_of(data: bytes) -> list[Any]:
    """The run writes of a piece of the stream, in order (for tests)."""
    u = unpacker()
    u.feed(data)
    return list(u)


def record_of(fields: Sequence[Any] | None) -> dict[str, Any]:
    """The run fields a write carries (once its run ended) as the record `TraceBuilder` reads."""
    return {} if fields is None else dict(zip(RUN_FIELDS, fields))


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


def serve(url: str, batch: int, delay_s: float, stream: int, counts: Counters) -> None:
    """Export what arrives on the descriptor ``stream`` until it ends; count into ``counts``."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    from stepd.sansio.trace import TraceBuilder

    exporter = OTLPSpanExporter(endpoint=url)
    send = sender(exporter)
    builder = TraceBuilder()
    writes = unpacker()
    pending: list[SpanData] = []
    oldest = 0.0  # when the oldest pending span arrived
    received = exported = failed = 0

    def flush(upto: int) -> None:
        nonlocal exported, failed
        for i in range(0, upto, batch):
            chunk = pending[i:min(i + batch, upto)]
            if send(chunk):
                exported += len(chunk)
            else:
                failed += len(chunk)
            counts[EXPORTED], counts[FAILED] = exported, failed
        del pending[:upto]

    try:
        ended = False
        last_read = 0.0
        while not ended:
            nap = min(last_read + READ_EVERY_S,
                      oldest + delay_s if pending else math.inf) - time.monotonic()
            if nap > 0:
                time.sleep(nap)
            wait = None if not pending else max(0.0, oldest + delay_s - time.monotonic())
            if select.select([stream], [], [], wait)[0]:
                data = os.read(stream, READ_BYTES)
                # A full read may have left more behind: read on at once, no nap.
                last_read = time.monotonic() if len(data) < READ_BYTES else 0.0
                ended = not data
                writes.feed(data)
                for run_id, fields, journal, leases, lease_status in writes:
                    received += 1
                    spans = builder.feed(run_id, record_of(fields), journal, leases,
                                         lease_status)
                    if spans and not pending:
                        oldest = time.monotonic()
                    pending.extend(spans)
                counts[RECEIVED] = received
                counts[FORGOTTEN] = builder.forgotten
            if len(pending) >= batch:
                flush(len(pending) - len(pending) % batch)
                oldest = time.monotonic()  # what is left arrived in this read, or just before
            if pending and (ended or time.monotonic() >= oldest + delay_s):
                flush(len(pending))
            if not pending:
                counts[DONE] = received
    finally:
        exporter.shutdown()  # type: ignore[no-untyped-call]  # the SDK leaves it untyped


def main() -> None:
    # Best effort yields to the daemon: when the cores are busy, the daemon's work goes
    # first, and a child that falls behind backs up into the bounded queue (counted drops).
    with contextlib.suppress(OSError):
        os.nice(10)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s (span export): %(message)s")
    url, batch, delay_s, fd = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    counts = Counters(fd)
    os.close(fd)  # the map holds its own
    serve(url, max(1, batch), max(0.0, delay_s), sys.stdin.fileno(), counts)


if __name__ == "__main__":
    main()
