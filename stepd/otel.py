"""OpenTelemetry export of runs, step attempts and body spans (docs/otel.md).

``stepd serve --otlp-endpoint URL`` and ``stepd.embedded(path,
otlp_endpoint=URL)`` export over OTLP/HTTP (protobuf) what the daemon
commits: a span per run, per step attempt, and the body spans workers
report (`stepd.sansio.trace` says which and with what attributes). The
OpenTelemetry packages are an extra (``pip install 'stepd[otel]'``); this
module imports them only when an export is opened, so a daemon without the
flag imports nothing of them and does no work per step.

Why a hand-off of our own rather than OpenTelemetry's ``BatchSpanProcessor``
behind a tracer: the spans describe committed journal entries, so they are
built after the commit, from the write itself, and building them (hashing
ids, converting attributes, making SDK span objects) is work the event loop
should not do. The loop's whole share is `SpanExport.committed`: one length
check and one ``deque.append`` per committed write. One thread of the
export's own drains the queue, builds the spans (`TraceBuilder`), and sends
them in batches through OpenTelemetry's ``OTLPSpanExporter`` (which honours
``OTEL_EXPORTER_OTLP_HEADERS``, ``..._TIMEOUT``, ``..._COMPRESSION``,
``..._CERTIFICATE`` and their ``..._TRACES_...`` forms). The queue is
bounded: when the collector is slow or gone, writes are dropped and counted
(`ExportStats.dropped`), never waited for.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.to_thread

from stepd.sansio.errors import Invalid
from stepd.sansio.trace import SpanData, TraceBuilder

__all__ = ["INSTALL_HINT", "ExportStats", "SpanExport", "open_export", "traces_url"]

log = logging.getLogger("stepd.otel")

INSTALL_HINT = "pip install 'stepd[otel]'"
"""What to install for export (opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http)."""

MAX_QUEUE = 65_536
"""Writes waiting for the export thread; past it, writes are dropped and counted."""
WAKE_AT = 1_024
"""Queued writes that wake the export thread before its delay is up."""
DEFAULT_DELAY_S = 1.0
"""How long the export thread waits between drains (``OTEL_BSP_SCHEDULE_DELAY``, ms, overrides)."""
DEFAULT_BATCH = 512
"""Spans per OTLP request (``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` overrides)."""
CLOSE_TIMEOUT_S = 10.0
"""How long closing waits for what is queued to be sent."""


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL for ``--otlp-endpoint``.

    A bare collector address (``http://host:4318``, no path) gets the
    standard ``/v1/traces`` path, as ``OTEL_EXPORTER_OTLP_ENDPOINT`` would;
    a URL with a path is used as given (as ``..._TRACES_ENDPOINT`` would).

    Raises:
        Invalid: not an http(s) URL with a host (``field="otlp_endpoint"``).
    """
    if not isinstance(endpoint, str):
        raise Invalid("must be an http:// or https:// URL", field="otlp_endpoint")
    parts = urlsplit(endpoint.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise Invalid(f"must be an http:// or https:// URL with a host, not {endpoint!r}",
                      field="otlp_endpoint")
    if parts.path in ("", "/"):
        return endpoint.strip().rstrip("/") + "/v1/traces"
    return endpoint.strip()


def _require() -> None:
    """Raises: Invalid naming the extra to install, when OpenTelemetry is missing."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter
        import opentelemetry.sdk.trace  # noqa: F401 - imported to see that it is there
    except ImportError as exc:
        raise Invalid(
            f"exporting traces needs the OpenTelemetry packages ({exc.name or exc} is not "
            f"installed): {INSTALL_HINT}", field="otlp_endpoint") from exc


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        raise Invalid(f"must be a number, not {raw!r}", field=name) from None
    if value <= 0:
        raise Invalid(f"must be positive, not {raw!r}", field=name)
    return value


@dataclass(frozen=True, slots=True)
class ExportStats:
    """What the export did so far (``/metrics``: ``stepd_otel_*``).

    Attributes:
        queued: writes waiting for the export thread now.
        dropped: writes dropped because the queue was full (their spans are lost).
        exported: spans the collector accepted.
        failed: spans whose request failed (after the exporter's own retries).
        forgotten: attempts whose offer the builder forgot (too many open at once).
    """

    queued: int
    dropped: int
    exported: int
    failed: int
    forgotten: int


class SpanExport:
    """The daemon's span export: a bounded hand-off, a thread, an OTLP/HTTP exporter.

    Open with `open_export` (or `start` and `close`). `committed` is the
    `stepd.actors.daemon.services.TraceSink` the run actors call.

    Args:
        endpoint: the collector (see `traces_url`).
        exporter: an OpenTelemetry ``SpanExporter`` to use instead of OTLP/HTTP
            (tests of the hand-off; the daemon always sends OTLP/HTTP).
        max_queue: `MAX_QUEUE`.

    Raises:
        Invalid: a bad endpoint, a bad ``OTEL_BSP_*`` value, or OpenTelemetry
            not installed (the message names `INSTALL_HINT`).
    """

    def __init__(self, endpoint: str, *, exporter: Any = None, max_queue: int = MAX_QUEUE) -> None:
        self.url = traces_url(endpoint)
        _require()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        from stepd import _otel_spans

        self._exporter = exporter if exporter is not None else OTLPSpanExporter(endpoint=self.url)
        self._convert = _otel_spans.Converter()
        self._delay_s = _env_number("OTEL_BSP_SCHEDULE_DELAY", DEFAULT_DELAY_S * 1000) / 1000
        self._batch = int(_env_number("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", DEFAULT_BATCH))
        self._max_queue = max_queue
        self._queue: collections.deque[tuple[str, Any, Any, Any, Any]] = collections.deque()
        self._wake = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._builder = TraceBuilder()
        self._dropped = 0
        self._exported = 0
        self._failed = 0

    # -- the event loop's side ------------------------------------------------------------

    def committed(self, write: Any) -> None:
        """Hand over a committed `RunWrite` (see `TraceSink`): never blocks, never raises."""
        queue = self._queue
        n = len(queue)
        if n >= self._max_queue:
            self._dropped += 1
            return
        queue.append((write.run_id, write.record, write.journal, write.leases, write.lease_status))
        if n == WAKE_AT:
            self._wake.set()

    def statistics(self) -> ExportStats:
        return ExportStats(queued=len(self._queue), dropped=self._dropped,
                           exported=self._exported, failed=self._failed,
                           forgotten=self._builder.forgotten)

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="stepd-otel-export", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Send what is queued (at most ``timeout_s``), stop the thread, shut the exporter."""
        self._closing = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("stepd: span export did not finish within %.0f s; %d writes unsent",
                            timeout_s, len(self._queue))
        self._exporter.shutdown()

    # -- the export thread ----------------------------------------------------------------

    def _main(self) -> None:
        while True:
            self._wake.wait(self._delay_s)
            self._wake.clear()
            closing = self._closing
            try:
                self._drain()
            except Exception:  # a bug here must not stop export for good
                log.exception("stepd: span export failed; going on")
            if closing and not self._queue:
                return

    def _drain(self) -> None:
        queue = self._queue
        pending: list[SpanData] = []
        while queue:
            run_id, record, journal, leases, lease_status = queue.popleft()
            pending.extend(self._builder.feed(run_id, record, journal, leases, lease_status))
            if len(pending) >= self._batch:
                self._send(pending[:self._batch])
                del pending[:self._batch]
        if pending:
            self._send(pending)

    def _send(self, spans: list[SpanData]) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult

        batch = self._convert.spans(spans)
        t0 = time.perf_counter()
        result = self._exporter.export(batch)
        if result is SpanExportResult.SUCCESS:
            self._exported += len(batch)
        else:
            self._failed += len(batch)
            log.warning("stepd: %d spans not accepted by %s (after %.1f s)", len(batch), self.url,
                        time.perf_counter() - t0)


@contextlib.asynccontextmanager
async def open_export(endpoint: str | None) -> AsyncIterator[SpanExport | None]:
    """The export for ``endpoint``, running while inside; None (and no import) without one.

    Leaving sends what is queued (at most `CLOSE_TIMEOUT_S`) from a worker
    thread: the event loop is not held while the collector answers.

    Raises:
        Invalid: see `SpanExport`.
    """
    if not endpoint:
        yield None
        return
    export = SpanExport(endpoint)
    export.start()
    try:
        yield export
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(export.close)
