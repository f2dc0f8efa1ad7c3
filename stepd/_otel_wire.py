"""What the daemon and its span export child share (docs/otel.md): the stream and the counts.

The stream (the child's standard input): one msgpack array per committed run
write, back to back, ``[run_id, run fields or nil, journal, leases,
lease_status]`` as the daemon committed them; the run fields are the values
of `RUN_FIELDS`, in that order, and only once the run has ended. No frames:
the child's unpacker takes whatever a read returned, so a write the pipe
took in two pieces costs nothing.

The counts (`Counters`): five 64-bit integers in a small file both map. The
child writes them, the daemon reads them when asked (``/metrics``), so no
answer travels back and nothing in the daemon waits for one. Each is
written by one process only; a reader may see one count a moment newer
than another, never a torn one (aligned 8-byte stores).
"""

from __future__ import annotations

import mmap
import os
import tempfile
from typing import Any

__all__ = ["DONE", "EXPORTED", "FAILED", "FORGOTTEN", "RECEIVED", "RUN_FIELDS", "Counters"]

#: The run record's fields a run span is made of, in the order the stream carries them.
RUN_FIELDS = ("workflow", "version", "hash", "created_at", "correlation", "idempotency_key",
              "parent", "input_tokens", "output_tokens", "cost_usd")

EXPORTED = 0
"""Spans the collector accepted."""
FAILED = 1
"""Spans whose request failed (after the exporter's own retries)."""
FORGOTTEN = 2
"""Attempts whose offer the builder forgot (too many open at once)."""
RECEIVED = 3
"""Writes the child has read off the stream."""
DONE = 4
"""Writes whose spans have all been sent (accepted or failed)."""
_SLOTS = 5


class Counters:
    """The shared counts: ``counters[EXPORTED]`` and so on (plain ints, read and written).

    ``view`` is the same as a memoryview of int64: ``view[RECEIVED]`` is a
    subscript, not a call, for the one read per write on the event loop.
    """

    def __init__(self, fd: int) -> None:
        self._map = mmap.mmap(fd, _SLOTS * 8)
        self.view: Any = memoryview(self._map).cast("q")

    @classmethod
    def create(cls) -> tuple[Counters, int]:
        """New zeroed counts, and the descriptor of their file for the child (close it once
        the child has it: the map holds its own)."""
        fd, path = tempfile.mkstemp(prefix="stepd-otel-")
        os.unlink(path)  # nothing left behind, whoever dies first
        os.ftruncate(fd, _SLOTS * 8)
        return cls(fd), fd

    def __getitem__(self, slot: int) -> int:
        return int(self.view[slot])

    def __setitem__(self, slot: int, value: int) -> None:
        self.view[slot] = value
