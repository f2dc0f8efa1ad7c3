"""OpenTelemetry export of runs, step attempts and body spans (docs/otel.md).

``stepd serve --otlp-endpoint URL`` and ``stepd.embedded(path,
otlp_endpoint=URL)`` export over OTLP/HTTP (protobuf) what the daemon
commits: a span per run, per step attempt, and the body spans workers
report (`stepd.sansio.trace` says which and with what attributes). The
OpenTelemetry packages are an extra (``pip install 'stepd[otel]'``); the
daemon's process never imports them, and without the flag nothing of this
runs at all: no work per step.

Where the work happens, and why:

* On the event loop, `SpanExport.committed`: one length check and one
  ``deque.append`` per committed run write. The queue is bounded
  (`MAX_QUEUE`); when it is full the write is dropped and counted
  (`ExportStats.dropped`), never waited for.
* On the export's thread: every ``OTEL_BSP_SCHEDULE_DELAY`` (or sooner, at
  `WAKE_AT` queued writes) it takes what is queued and packs the writes as
  they were committed, whole (journal entries and lease records; of the run
  record only a run span's fields, and only when the write ends the run),
  with msgpack in chunks of `PACK_CHUNK` writes, one frame down a pipe; then
  it waits for the frame's answer. One Python call per write (`_wire`),
  none per entry or span: the entries are packed in C
  (``tests/otel/test_handoff_cost.py`` counts it). One frame in flight: a
  slow collector backs up into the bounded queue, where it is counted, not
  into memory.
* In a child process (`stepd._otel_child`, started and stopped with the
  export, by PID): the `TraceBuilder`, the protobuf encoding
  (`stepd._otlp_proto`, written directly: a fifth of the SDK's CPU per
  span) and the sending, by OpenTelemetry's ``OTLPSpanExporter``'s own HTTP
  client (which honours ``OTEL_EXPORTER_OTLP_HEADERS``, ``..._TIMEOUT``,
  ``..._COMPRESSION``, ``..._CERTIFICATE`` and their ``..._TRACES_...``
  forms). Done in the daemon's process, building and encoding spans took the
  GIL from the event loop; in its own process it runs on the other core, at
  nice 10. docs/otel.md, "What export costs", has the counts.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.to_thread
import msgpack  # type: ignore[import-untyped]  # no stubs published

from stepd.sansio.errors import Invalid
from stepd.sansio.trace import RUN_ENDS

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
    """Raises: Invalid naming the extra to install, when OpenTelemetry is missing.

    Looks without importing (the child process imports).
    """
    for name in ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http"):
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise Invalid(f"exporting traces needs the OpenTelemetry packages ({name} is not "
                          f"installed): {INSTALL_HINT}", field="otlp_endpoint")


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


#: Writes packed per msgpack call: the export thread lets go of the GIL between them.
PACK_CHUNK = 256
#: A frame stops taking writes past this size (step outputs cross whole: a few large ones
#: must not make one frame of gigabytes).
FRAME_BYTES = 16 << 20


#: The run record's fields a run span is made of.
_RUN_FIELDS = ("workflow", "version", "hash", "created_at", "correlation", "idempotency_key",
               "parent", "input_tokens", "output_tokens", "cost_usd")


def _wire(write: Any) -> tuple[Any, ...]:
    """A write as the child reads it: its journal and lease records as committed, whole (one
    C call packs them); of the run record, only a run span's fields, only when it ends."""
    journal = write.journal
    record = None
    for entry in journal:
        if entry.get("type") in RUN_ENDS:
            record = {k: write.record.get(k) for k in _RUN_FIELDS}
            break
    return (write.run_id, record, journal, write.leases, write.lease_status)


class SpanExport:
    """The daemon's span export: a bounded hand-off, a thread, a child process (see above).

    Open with `open_export` (or `start` and `close`). `committed` is the
    `stepd.actors.daemon.services.TraceSink` the run actors call.

    Args:
        endpoint: the collector (see `traces_url`).
        max_queue: `MAX_QUEUE`.

    Raises:
        Invalid: a bad endpoint, a bad ``OTEL_BSP_*`` value, or OpenTelemetry
            not installed (the message names `INSTALL_HINT`).
    """

    def __init__(self, endpoint: str, *, max_queue: int = MAX_QUEUE) -> None:
        self.url = traces_url(endpoint)
        _require()
        self._delay_s = _env_number("OTEL_BSP_SCHEDULE_DELAY", DEFAULT_DELAY_S * 1000) / 1000
        self._batch = int(_env_number("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", DEFAULT_BATCH))
        self._max_queue = max_queue
        self._queue: collections.deque[Any] = collections.deque()
        self._wake = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._dropped = 0
        self._exported = 0
        self._failed = 0
        self._forgotten = 0

    # -- the event loop's side ------------------------------------------------------------

    def committed(self, write: Any) -> None:
        """Hand over a committed `RunWrite` (see `TraceSink`): never blocks, never raises."""
        queue = self._queue
        n = len(queue)
        if n >= self._max_queue:
            self._dropped += 1
            return
        queue.append(write)
        if n == WAKE_AT:
            self._wake.set()

    def statistics(self) -> ExportStats:
        return ExportStats(queued=len(self._queue), dropped=self._dropped,
                           exported=self._exported, failed=self._failed,
                           forgotten=self._forgotten)

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Start the child process and the thread that feeds it."""
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "stepd._otel_child", self.url, str(self._batch)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._thread = threading.Thread(target=self._main, name="stepd-otel-export", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Send what is queued (at most ``timeout_s``), then stop the thread and the child."""
        self._closing = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("stepd: span export did not finish within %.0f s; %d writes unsent",
                            timeout_s, len(self._queue))
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)  # only when the thread gave up on it
            proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()

    # -- the export thread ----------------------------------------------------------------

    def _main(self) -> None:
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        try:
            while True:
                self._wake.wait(self._delay_s)
                self._wake.clear()
                closing = self._closing
                if self._queue and not self._send(proc.stdin, proc.stdout):
                    return
                if closing and not self._queue:
                    break
            proc.stdin.close()  # the child sends what it holds, answers, and exits
            self._answer(proc.stdout)
            proc.wait(CLOSE_TIMEOUT_S)
        except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
            log.error("stepd: the span export process failed (%r); spans are no longer "
                      "exported", exc)

    def _frame(self) -> tuple[bytes, int]:
        """Up to ``4 * WAKE_AT`` queued writes (fewer past `FRAME_BYTES`) as one frame (length,
        then msgpack arrays of at most `PACK_CHUNK`), and how many it holds. Python per
        write: `_wire`, no more."""
        queue = self._queue
        pack = msgpack.Packer(default=str).pack
        parts = [b""]
        taken = size = 0
        while queue and taken < 4 * WAKE_AT and size < FRAME_BYTES:
            chunk = [_wire(queue.popleft()) for _ in range(min(PACK_CHUNK, len(queue)))]
            taken += len(chunk)
            packed = pack(chunk)
            size += len(packed)
            parts.append(packed)
        parts[0] = size.to_bytes(4, "big")
        return b"".join(parts), taken

    def _send(self, pipe: Any, answers: Any) -> bool:
        """One frame of what is queued, then its answer. False: the child is gone."""
        queue = self._queue
        frame, taken = self._frame()
        try:
            pipe.write(frame)
            pipe.flush()
        except OSError as exc:
            self._dropped += taken + len(queue)
            queue.clear()
            log.error("stepd: the span export process is gone (%r); spans are no longer "
                      "exported", exc)
            return False
        return self._answer(answers)

    def _answer(self, answers: Any) -> bool:
        """Read the child's counts after a frame: ``exported failed forgotten`` (totals)."""
        line = answers.readline()
        if not line:
            return False
        exported, failed, forgotten = (int(x) for x in line.split())
        self._exported, self._failed, self._forgotten = exported, failed, forgotten
        return True


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
