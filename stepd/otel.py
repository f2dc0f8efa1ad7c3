"""OpenTelemetry export of runs, step attempts and body spans (docs/otel.md).

``stepd serve --otlp-endpoint URL`` and ``stepd.embedded(path,
otlp_endpoint=URL)`` export over OTLP/HTTP (protobuf) what the daemon
commits: a span per run, per step attempt, and the body spans workers
report (`stepd.sansio.trace` says which and with what attributes). The
OpenTelemetry packages are an extra (``pip install 'stepd[otel]'``); the
daemon's process never imports them, and without the flag nothing of this
runs at all: no work per step.

Where the work happens, and why:

* On the event loop, `SpanExport.committed`: the write packed as it was
  committed, whole (journal entries and lease records; of the run record
  only a run span's fields, and only once the run has ended), by one msgpack
  call in C, onto a byte buffer; nothing of the write is kept. At most every
  `FLUSH_S` (a timer armed by the first write of a period), or at
  `FLUSH_BYTES`, the buffer goes down the pipe to the child in one
  non-blocking ``os.write``; what a full pipe does not take waits in the
  buffer for the next flush. The writes the child has not read are bounded
  (`MAX_QUEUE`): past that a write is dropped and counted
  (`ExportStats.dropped`), never waited for.
* No thread of its own. An earlier version queued the writes themselves for
  an export thread that woke every second and packed them: the writes lived
  that second, long enough to survive the young generation, so every
  collection of the older one walked them again (on the event loop's thread),
  and packing took the GIL the event loop wanted. ``python -m
  bench.otel_cost`` counts both (docs/otel.md, "Waking rarely").
* In a child process (`stepd._otel_child`, started and stopped with the
  export, by PID, at nice 10): the `TraceBuilder`, the protobuf encoding
  (`stepd._otlp_proto`, written directly: a fifth of the SDK's CPU per
  span) and the sending, by OpenTelemetry's ``OTLPSpanExporter``'s own HTTP
  client (which honours ``OTEL_EXPORTER_OTLP_HEADERS``, ``..._TIMEOUT``,
  ``..._COMPRESSION``, ``..._CERTIFICATE`` and their ``..._TRACES_...``
  forms), in requests of ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` spans at most
  ``OTEL_BSP_SCHEDULE_DELAY`` after their write arrived. It reports its counts
  in a small shared file (`_Counters`), so that nothing in the daemon waits
  for or reads an answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib.util
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.to_thread
import msgpack  # type: ignore[import-untyped]  # no stubs published

from stepd._otel_wire import DONE, EXPORTED, FAILED, FORGOTTEN, RECEIVED, RUN_FIELDS, Counters
from stepd.sansio.errors import Invalid
from stepd.sansio.trace import RUN_ENDS

__all__ = ["INSTALL_HINT", "ExportStats", "SpanExport", "open_export", "traces_url"]

log = logging.getLogger("stepd.otel")

INSTALL_HINT = "pip install 'stepd[otel]'"
"""What to install for export (opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http)."""

MAX_QUEUE = 65_536
"""Writes handed over that the child has not read yet; past it, writes are dropped and counted."""
FLUSH_S = 0.1
"""How long packed writes wait on the event loop before one write down the pipe."""
FLUSH_BYTES = 256 << 10
"""Packed bytes that go down the pipe at once, without waiting for `FLUSH_S`."""
PIPE_BYTES = 1 << 20
"""The pipe's capacity asked for (Linux ``F_SETPIPE_SZ``; best effort): a second of B's writes."""
DEFAULT_DELAY_S = 1.0
"""How long a span waits in the child for more (``OTEL_BSP_SCHEDULE_DELAY``, ms, overrides)."""
DEFAULT_BATCH = 512
"""Spans per OTLP request (``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` overrides)."""
CLOSE_TIMEOUT_S = 10.0
"""How long closing waits for what is queued to be sent."""

#: The record's status once its run has ended: only then does a write carry the run's fields.
_ENDED = frozenset(RUN_ENDS.values())
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


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
        queued: writes handed over that the child has not read yet (packed and
            waiting on the event loop, or in the pipe); the child sends a
            span at most ``OTEL_BSP_SCHEDULE_DELAY`` after reading it.
        dropped: writes dropped because `MAX_QUEUE` were queued, or the child
            was gone, or the export was closing (their spans are lost).
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
    """The daemon's span export: a packed hand-off and a child process (see above).

    Open with `open_export` (or `start`, then `stop` and `close`).
    `committed` is the `stepd.actors.daemon.services.TraceSink` the run
    actors call, on the event loop's thread (the thread that calls `start`;
    outside an event loop each write goes down the pipe at once, as nothing
    would come back to flush it).

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
        self._buf = bytearray()
        self._pack = msgpack.Packer(default=str).pack
        self._counters, self._counters_fd = Counters.create()
        self._seen = self._counters.view  # read per write: a subscript, no call
        self._taken = 0  # writes packed onto the buffer, in all
        self._dropped = 0
        self._accepting = True
        self._armed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    # -- the event loop's side ------------------------------------------------------------

    def committed(self, write: Any) -> None:
        """Hand over a committed `RunWrite` (see `TraceSink`): never blocks, never raises.

        Packs it whole in one C call and keeps nothing of it: a write held
        until a thread got to it lived long enough for the collector to
        walk it again and again (see the module docstring).
        """
        if self._taken - self._seen[RECEIVED] >= self._max_queue or not self._accepting:
            self._dropped += 1
            return
        record = write.record
        buf = self._buf
        idle = not buf
        try:
            buf += self._pack((write.run_id,
                               tuple(map(record.get, RUN_FIELDS))
                               if record.get("status") in _ENDED else None,
                               write.journal, write.leases, write.lease_status))
        except (TypeError, ValueError, OverflowError):  # the storage encoded it: never seen
            self._dropped += 1
            return
        self._taken += 1
        if idle:
            self._arm()
        elif len(buf) >= FLUSH_BYTES:
            self._flush()

    def statistics(self) -> ExportStats:
        c = self._counters
        return ExportStats(queued=max(0, self._taken - c[RECEIVED]), dropped=self._dropped,
                           exported=c[EXPORTED], failed=c[FAILED], forgotten=c[FORGOTTEN])

    def _arm(self) -> None:
        """Flush in `FLUSH_S` (once per period, whatever arrives meanwhile)."""
        if self._loop is None:
            self._flush()
        elif not self._armed:
            self._armed = True
            self._loop.call_later(FLUSH_S, self._tick)

    def _tick(self) -> None:
        self._armed = False
        self._flush()
        if self._buf and self._accepting:
            self._arm()  # what the pipe did not take: the next period

    def _flush(self) -> None:
        """One non-blocking write of what is packed; a full pipe leaves the rest for later."""
        buf, fd = self._buf, self._fd
        if not buf or fd is None or not self._accepting:
            return
        try:
            n = os.write(fd, buf)
        except BlockingIOError:
            return
        except OSError as exc:
            self._gone(exc)
            return
        del buf[:n]

    def _gone(self, exc: BaseException) -> None:
        """The child died: what it had not sent is lost, counted; later writes are dropped."""
        self._accepting = False
        self._buf.clear()
        done = self._counters[DONE]
        self._dropped += self._taken - done
        self._taken = done
        log.error("stepd: the span export process is gone (%r); spans are no longer "
                  "exported", exc)

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Start the child; writes packed before go to it now."""
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        proc = self._proc = subprocess.Popen(
            [sys.executable, "-m", "stepd._otel_child", self.url, str(self._batch),
             str(self._delay_s), str(self._counters_fd)],
            stdin=subprocess.PIPE, pass_fds=(self._counters_fd,))
        os.close(self._counters_fd)  # the child has its own; the map holds ours
        assert proc.stdin is not None
        fd = proc.stdin.fileno()
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_BYTES)
        os.set_blocking(fd, False)
        self._fd = fd
        if self._buf:
            self._arm()

    def stop(self) -> None:
        """Take no more writes (count them as dropped); on the event loop's thread, before
        `close` runs elsewhere: from here on only `close` touches what is packed."""
        self._accepting = False

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Send what is packed and let the child send it on (at most ``timeout_s`` in all),
        then stop it; past the time it is killed, and what it had not sent counts as
        dropped."""
        self._accepting = False
        proc, fd = self._proc, self._fd
        if proc is None or fd is None:
            return
        deadline = time.monotonic() + timeout_s
        buf = self._buf
        try:
            while buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                if select.select([], [fd], [], left)[1]:
                    with contextlib.suppress(BlockingIOError):
                        del buf[:os.write(fd, buf)]
        except OSError as exc:  # the child is gone
            log.error("stepd: the span export process is gone (%r)", exc)
        if buf:
            log.warning("stepd: span export did not take everything within %.0f s", timeout_s)
            buf.clear()
        assert proc.stdin is not None
        with contextlib.suppress(OSError):
            proc.stdin.close()  # the child sends what it holds and exits
        self._fd = None
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("stepd: span export did not finish within %.0f s; stopping it",
                        timeout_s)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        done = self._counters[DONE]
        self._dropped += self._taken - done  # nothing unsent goes uncounted
        self._taken = done


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
        export.stop()
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(export.close)
