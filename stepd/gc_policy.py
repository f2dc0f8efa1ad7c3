"""The garbage-collector settings a stepd daemon runs with.

CPython's cyclic GC runs a *full* collection, walking every live object,
each time the objects that survived two young collections reach a quarter of
the long-lived heap. A daemon under load keeps thousands of runs in flight,
each living for a few seconds: nearly all of their objects survive the young
collections (700 allocations apart by default), so full collections come
every few thousand steps, and each walks the whole heap. Measured with
``python -m bench --only B --transport websocket``: the daemon spent about a
third of its CPU in the collector, and throughput rose by about a third with
it switched off.

`tune_gc` keeps the collector on (reference cycles still get collected) but
makes full passes rare and cheaper:

* ``gc.freeze()`` moves everything alive at startup (modules, classes,
  functions: ~50,000 objects) out of the collector's sight for good;
* the young generation's threshold goes from 700 to 10,000 allocations, so
  most objects of a request or a step are freed by reference counting before
  any collection sees them, and fewer reach the old generation.

Memory is bounded the same way as before: only cyclic garbage waits longer
(stepd's actors leave none when they end, see `Runtime.release`), and RSS
under bench B and E is unchanged within noise.

``stepd serve`` calls it at startup (``--gc default`` keeps CPython's
settings). An embedded daemon lives in your process, so stepd leaves your
collector alone; call `tune_gc` yourself at startup if throughput matters
and nothing else in the process depends on the defaults.
"""

from __future__ import annotations

import gc

__all__ = ["YOUNG_THRESHOLD", "tune_gc"]

YOUNG_THRESHOLD = 10_000
"""Allocations (minus deallocations) between two young collections."""


def tune_gc() -> None:
    """Freeze what is alive now and raise the young generation's threshold.

    Process-wide; call it once, after imports and startup, before the work.
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
